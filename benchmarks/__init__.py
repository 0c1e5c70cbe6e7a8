"""megalite's development tools, outside the product (torchtitan keeps its benchmarks outside its package the
same way): nothing in megalite/ imports them. Run from a checkout (the repository root on sys.path):

    python -m benchmarks stress ckpt --trials 10     stress.py: kill a random rank mid-save, check nothing is lost
    python -m benchmarks phases                      phases.py: where a (1,1,1) step's time goes, vs plain PyTorch
    python -m benchmarks transcripts --check walk    transcripts.py: run the docs' commands, compare the output
    python -m benchmarks walk save|convert ARGS      walk.py: which files of megalite/ a save or a convert enters
    simcluster.py                                    simulated hosts on one Linux machine, for multi-host tests

What a user measures on their own system stays in the product: `megalite bench ...` (megalite/bench/).
"""
