"""The converter: any layout -> one file, -> Hugging Face GPT-2, one file -> any layout, and layout -> layout.

Everything that reads a checkpoint is driven by its manifest: the global shapes, the partition tags and
the slices. Only `split` (whose input has no manifest) asks the model code for the partition tags.

    common.py    errors, progress, output safety, partition tags, full tensors from a checkpoint
    single.py    `megalite convert`: one safetensors file; reading one model file back
    hf.py        Hugging Face GPT-2 names, config.json, export and import
    resharding.py `megalite split` and `megalite reshard`: a whole checkpoint written in one process
    foreign.py   other trainers' checkpoints: source detection (--from), the converter for them, --format dcp
    megatron.py  a Megatron-LM torch_dist GPT as megalite names and layout (refusing what megalite does not model)
    dcp.py       PyTorch DCP folders read chunk by chunk (no pickle run) and written in DCP's HF storage format
    unpickle.py  the allow-list unpickler for the pickles those formats keep their indexes in
"""
from .common import DTYPES, ConvertError, Progress, check_layout, check_manifest_tensors, model_partitions
from .resharding import reshard, split
from .single import FORMATS, convert, read_model_file

__all__ = ["DTYPES", "FORMATS", "ConvertError", "Progress", "check_layout", "check_manifest_tensors",
           "convert", "model_partitions", "read_model_file", "reshard", "split"]
