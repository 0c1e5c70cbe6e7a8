"""The converter: every input is one Source, every output one Sink.

    common.py     the Source interface, metadata keys, errors, progress, output safety, partition tags
    sources.py    megalite's own sources (a step folder, one file) and `open_source` (which input is which)
    family.py     model families: the megalite <-> transformers name table and reshapes, config.json both ways
    hf.py         transformers folders: read as a Source, written (sharded, with config and tokenizer)
    dcp.py        PyTorch DCP folders read chunk by chunk (no pickle run) as a Source, and written
    megatron.py   a Megatron-LM torch_dist GPT as a Source (refusing what megalite does not model)
    unpickle.py   the allow-list unpickler for the pickles those formats keep their indexes in
    sink.py       the outputs of `convert` (one file, DCP, transformers) and `deliver`: temp -> check -> move
    check.py      `convert --check`: the source's forward against the result's on fixed prompts
    single.py     `megalite convert`: a source, a sink, the check
    resharding.py `megalite split` and `megalite reshard`: a whole checkpoint written in one process
"""
from .common import DTYPES, ConvertError, Progress, Source, check_layout, check_manifest_tensors, model_partitions
from .resharding import reshard, split
from .single import FORMATS, convert
from .sources import open_source

__all__ = ["DTYPES", "FORMATS", "ConvertError", "Progress", "Source", "check_layout", "check_manifest_tensors",
           "convert", "model_partitions", "open_source", "reshard", "split"]
