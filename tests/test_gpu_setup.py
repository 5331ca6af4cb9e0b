"""The GPU job's set-up decisions that need no GPU: when NCCL carries device arrays, and the
datasheet peak MFU is measured against (pympar.gpu)."""
import pytest

from pympar import gpu


@pytest.mark.parametrize("env, ranks, gpus, want", [
    ("", 1, 1, True), ("", 8, 8, True), ("", 4, 8, True),      # one GPU per rank: NCCL
    ("", 2, 1, False), ("", 8, 4, False),                       # ranks share GPUs: MPI, with a note
    ("0", 1, 8, False), ("1", 8, 8, True),
])
def test_nccl_only_with_a_gpu_per_rank(env, ranks, gpus, want):
    use, note = gpu.nccl_choice(env, ranks, gpus)
    assert use is want
    assert (note is not None) == (env == "" and ranks > gpus)
    if note:
        assert f"{ranks} ranks share {gpus} GPU" in note and "PYMPAR_NCCL=0" in note


def test_forced_nccl_on_shared_gpus_says_what_would_work():
    with pytest.raises(ValueError, match=r"PYMPAR_NCCL=1: 4 ranks share 2 GPU.*at most 2 rank\(s\) per node"):
        gpu.nccl_choice("1", 4, 2)


def test_malformed_setting_is_refused():
    with pytest.raises(ValueError, match="expected 0 .* 1 .* or unset"):
        gpu.nccl_choice("yes", 1, 1)


@pytest.mark.parametrize("name, dtype, want", [
    ("NVIDIA H200", "bfloat16", 989e12), ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA A100-SXM4-80GB", "float32", 19.5e12),
    ("Tesla V100-SXM2-16GB", "bfloat16", None), ("Tesla V100-SXM2-16GB", "float16", 125e12),
    ("NVIDIA A100-SXM4-80GB", "float16", 312e12), ("Some Future GPU", "bfloat16", None),
])
def test_peak_table(name, dtype, want):
    assert gpu.peak_flops(name, dtype) == want
