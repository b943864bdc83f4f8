"""A sweep-protocol module that imports nothing heavy: hostile specs are loaded
against it so that each `workbench sweep --dry-run` starts in a fraction of a
second (kernels.gemm imports torch). Nothing here is ever run by the corpus."""

PARAMS = {"block_m": 64, "block_k": 32, "num_stages": 2, "group_m": 8}
WORLD_SIZES = (2,)
baselines = {"none": lambda inputs: None}


def make_inputs(shape, dtype, device, seed):
    raise NotImplementedError("the hostile corpus only loads specs")


def run(inputs, **params):
    raise NotImplementedError


def reference(inputs):
    raise NotImplementedError


def flops(shape):
    return 2 * shape["M"] * shape["N"] * shape["K"]


def bytes_moved(shape, dtype):
    return 0


def tolerance(dtype):
    return 0.0
