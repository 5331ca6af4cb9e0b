"""GPU set-up for a training job: one GPU per rank, the job's communicator, the device's peak.

    dev = select_device(mpi_comm)            # cupy.cuda.Device(local_rank % n_gpus), made current
    comm = device_world(mpi_comm, timeout)   # DeviceComm: NCCL for CuPy arrays, MPI for host ones
    peak = peak_flops(dev_name(), "bfloat16")  # the datasheet's dense rate, or None if unknown

Nothing here runs on the CPU path; everything imports CuPy lazily.
"""
from __future__ import annotations


from . import backend

# Dense (no sparsity) tensor-core rates from the vendors' datasheets, FLOP/s per GPU, by a
# substring of the name CUDA reports. bf16 and fp16 are the same on these parts; "float32"
# is the plain (non-tensor-core) FP32 rate, which CuPy's float32 GEMMs get unless TF32 is on.
# Order matters: the first matching substring wins (H100 PCIe before H100 SXM, ...).
PEAKS = [
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),
    ("GH200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H800", {"bfloat16": 989e12, "float32": 67e12}),
    ("B200", {"bfloat16": 2250e12, "float32": 80e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("A800", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("A10G", {"bfloat16": 70e12, "float32": 31.2e12}),
    ("A10", {"bfloat16": 125e12, "float32": 31.2e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 91.6e12}),
    ("L40", {"bfloat16": 181e12, "float32": 90.5e12}),
    ("L4", {"bfloat16": 121e12, "float32": 30.3e12}),
    ("RTX 4090", {"bfloat16": 165e12, "float32": 82.6e12}),
    ("RTX 3090", {"bfloat16": 71e12, "float32": 35.6e12}),
    ("V100", {"bfloat16": 0.0, "float16": 125e12, "float32": 15.7e12}),   # no bf16 tensor cores
    ("T4", {"bfloat16": 0.0, "float16": 65e12, "float32": 8.1e12}),
]


def peak_flops(name: str, dtype: str = "bfloat16"):
    """The datasheet peak of GPU ``name`` for ``dtype`` ('bfloat16', 'float16', 'float32'), or
    None when the GPU is not in the table. float16 defaults to the bf16 rate where equal."""
    for key, rates in PEAKS:
        if key.lower() in name.lower():
            v = rates.get(dtype, rates.get("bfloat16") if dtype == "float16" else None)
            return v or None
    return None


def device_name() -> str:
    cp = backend.get_xp("cuda")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    n = props["name"]
    return n.decode() if isinstance(n, bytes) else str(n)


def local_rank(mpi_comm, launcher_local_rank=None) -> int:
    """This rank's index among the ranks of its node: the launcher's when given
    (pympar.config.Environment.local_rank), else found with MPI."""
    if launcher_local_rank is not None:
        return int(launcher_local_rank)
    return node_rank_size(mpi_comm)[0]


def node_rank_size(mpi_comm):
    """(rank, size) of this rank among the ranks of its node (a collective over mpi_comm)."""
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def nccl_choice(env: str, ranks_on_node_max: int, gpus: int):
    """(use NCCL?, a note for the user or None) from PYMPAR_NCCL ('' = auto, '0', '1') and how
    many ranks share the node's GPUs. NCCL refuses two ranks of one communicator on one GPU
    ("duplicate GPU"), so auto falls back to MPI (host staging, or CUDA-aware MPI) when ranks
    outnumber GPUs; PYMPAR_NCCL=1 with shared GPUs is an error that says so."""
    env = env.strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"PYMPAR_NCCL={env!r}: expected 0 (MPI for device arrays), 1 (NCCL) or unset (auto)")
    if env == "0":
        return False, None
    if ranks_on_node_max > gpus:
        msg = (f"{ranks_on_node_max} ranks share {gpus} GPU(s) on a node, and NCCL needs one GPU per rank")
        if env == "1":
            raise ValueError(f"PYMPAR_NCCL=1: {msg}: launch at most {gpus} rank(s) per node, or unset PYMPAR_NCCL "
                             f"to move device arrays over MPI instead")
        return False, f"{msg}: device arrays move over MPI (set PYMPAR_NCCL=0 to silence this note)"
    return True, None


def select_device(mpi_comm, launcher_local_rank=None):
    """Make GPU local_rank % n_gpus current for this process (one GPU per rank); returns it."""
    cp = backend.get_xp("cuda")
    n = cp.cuda.runtime.getDeviceCount()
    dev = cp.cuda.Device(local_rank(mpi_comm, launcher_local_rank) % n)
    dev.use()
    return dev


def bfloat16_supported() -> bool:
    """Whether this CuPy holds and multiplies bfloat16 arrays (CuPy 14 with ml_dtypes)."""
    cp = backend.cupy_or_none()
    if cp is None or backend.bfloat16 is None:
        return False
    try:
        a = cp.ones((2, 2), dtype=backend.bfloat16)
        return float((a @ a).astype(cp.float32)[0, 0]) == 2.0
    except Exception:
        return False


def device_world(mpi_comm, timeout=None, name="world", use_nccl=None, nccl=""):
    """The job's communicator on GPUs: DeviceComm over NCCL (CuPy operands) and MPI (host
    operands). use_nccl=False (or nccl="0", what PYMPAR_NCCL says) keeps everything on MPI:
    CUDA-aware MPI where the library says it is, host staging otherwise; "" (auto), NCCL is used
    unless ranks outnumber a node's GPUs (see nccl_choice)."""
    from .comm.hybrid import DeviceComm
    from .comm.mpi import MPIComm

    mpi = MPIComm(mpi_comm, name=name, timeout=timeout)
    if use_nccl is None and mpi.size > 1:
        from mpi4py import MPI

        most = mpi_comm.allreduce(node_rank_size(mpi_comm)[1], op=MPI.MAX)   # ranks on the fullest node
        gpus = backend.get_xp("cuda").cuda.runtime.getDeviceCount()
        use_nccl, note = nccl_choice(nccl, most, gpus)
        if note and mpi.rank == 0:
            print(f"pympar: note: {note}", flush=True)
    if use_nccl and mpi.size > 1:
        from .comm.nccl import NCCLComm

        return DeviceComm(NCCLComm(mpi, name=f"nccl:{name}", timeout=timeout))
    return DeviceComm.mpi_only(mpi)      # a single rank needs no NCCL communicator
