"""`python -m benchmarks TOOL [args]`: one of megalite's development tools (see benchmarks/__init__.py)."""
import importlib
import sys

TOOLS = {"stress": "benchmarks.stress", "phases": "benchmarks.phases", "transcripts": "benchmarks.transcripts",
         "walk": "benchmarks.walk"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TOOLS:
        print(f"usage: python -m benchmarks {{{','.join(TOOLS)}}} [args] (each has --help)", file=sys.stderr)
        return 2
    return importlib.import_module(TOOLS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
