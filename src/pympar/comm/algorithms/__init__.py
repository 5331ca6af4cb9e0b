"""pympar's own collective algorithms, built on point-to-point messages or shared memory.

ring.py (pipelined ring), doubling.py (recursive doubling, recursive halving, Rabenseifner;
any rank count), shm.py (MPI-3 shared-memory window), hierarchical.py (shm inside a node,
ring across node leaders). Each works on flat contiguous arrays; mpi.py dispatches to them.
"""
