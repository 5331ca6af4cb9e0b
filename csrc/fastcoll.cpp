// The per-call path of a planned collective in C (pympar/comm/plans.py, MPIComm._native).
//
// A repeated small collective costs what runs around the MPI library's call: in Python the
// checks a plan leaves, the call's count, its arrival on the watchdog board, the deadline's
// arming and mpi4py's own argument handling took about 1 us at 8 B against a ~2 us library
// call. Here the same steps run in C: the operands are checked against the plan (exactly
// NumPy, the plan's dtype object and shape, C-contiguous, aligned, a writable output), the
// communicator's count goes up, (count, op code) is stored on the arrival board, the deadline
// guard's slot is armed (blocking call) and the library's function runs with the GIL released
// (the guard thread and other threads run meanwhile).
//
// The library is reached through addresses and handles Python looked up from the loaded MPI
// library and mpi4py (no link against MPI here): handles are 4-byte integers (MPICH) or
// pointers (Open MPI), told by hbytes. An operand the plan does not fit returns None before
// anything happens, and the caller takes the Python path (which checks and raises as always).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace {

enum Verb { ALLREDUCE = 0, BROADCAST = 1, ALLGATHER = 2, ALLTOALL = 3 };
constexpr int MAXDIM = 32;
constexpr int C_CONTIG = 0x0001, ALIGNED = 0x0100, WRITEABLE = 0x0400;   // NumPy's array flags
const char* const CAPSULE = "pympar.fastcoll";

struct Buffer {   // a Python buffer held open for the plan's life (its memory is written through)
  Py_buffer view{};
  bool held = false;
  int64_t* p() const { return static_cast<int64_t*>(view.buf); }
};

struct Fast {
  int verb = 0, hbytes = 4, root = 0;
  bool blocking = true;
  void* call = nullptr;       // MPI_Allreduce, MPI_Bcast, ... (blocking) or MPI_I... (nonblocking)
  void* test = nullptr;       // MPI_Test
  int64_t comm = 0, type = 0, op = 0;
  void* in_place = nullptr;   // MPI_IN_PLACE
  PyObject* descr = nullptr;  // the operand's dtype object (identity checked)
  PyObject* op_obj = nullptr; // the call's op / algo / inplace arguments as the plan's key held them
  PyObject* algo_obj = nullptr;
  PyTypeObject* ndarray = nullptr;
  int ndim = 0, out_ndim = 0;
  Py_ssize_t dims[MAXDIM]{}, out_dims[MAXDIM]{};
  int count = 0;              // elements of the operand (allgather/alltoall: per rank)
  int64_t code = 0, token = 0;
  bool waits_block = false;   // the communicator's long waits may block in the library (on_timeout="abort")
  int64_t yield_ns = 0;       // after the spins, test and sched_yield for this long (0: hand over at once)
  Buffer seq, board, guard;   // the communicator's count; the board's [seq, op code]; the guard's [token, seq]
  Buffer pace;                // progress.PACE: [spins, 1 where an abort-mode wait blocks], read at each call
  alignas(16) char status[256]{};
};

void release(Fast* f) {
  for (Buffer* b : {&f->seq, &f->board, &f->guard, &f->pace})
    if (b->held) PyBuffer_Release(&b->view);
  Py_XDECREF(f->descr);
  Py_XDECREF(f->op_obj);
  Py_XDECREF(f->algo_obj);
  delete f;
}

void destroy(PyObject* cap) {
  auto* f = static_cast<Fast*>(PyCapsule_GetPointer(cap, CAPSULE));
  if (f) release(f);
}

void hold(Buffer& b, const py::object& o, Py_ssize_t n_int64) {
  if (PyObject_GetBuffer(o.ptr(), &b.view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  b.held = true;
  if (b.view.len < n_int64 * 8 || (reinterpret_cast<uintptr_t>(b.view.buf) & 7))
    throw py::value_error("fastcoll: a counter buffer is too small or misaligned");
}

// the operand fits the plan: exactly NumPy, the plan's dtype object, its shape, C-contiguous and
// aligned (and writable where the library writes it)
inline bool fits(const Fast* f, PyObject* a, int ndim, const Py_ssize_t* dims, bool write) {
  if (Py_TYPE(a) != f->ndarray) return false;
  auto* p = py::detail::array_proxy(a);
  int need = C_CONTIG | ALIGNED | (write ? WRITEABLE : 0);
  if (p->descr != f->descr || p->nd != ndim || (p->flags & need) != need) return false;
  for (int i = 0; i < ndim; ++i)
    if (p->dimensions[i] != dims[i]) return false;
  return true;
}

inline void* data(PyObject* a) { return py::detail::array_proxy(a)->data; }

// the library call with handles of type H (int: MPICH; void*: Open MPI)
template <typename H>
int issue(Fast* f, void* sbuf, void* rbuf, H* req) {
  const H comm = H(f->comm), type = H(f->type), op = H(f->op);
  const int n = f->count;
  switch (f->verb) {
    case ALLREDUCE:
      if (req) return reinterpret_cast<int (*)(const void*, void*, int, H, H, H, H*)>(f->call)(sbuf, rbuf, n, type, op, comm, req);
      return reinterpret_cast<int (*)(const void*, void*, int, H, H, H)>(f->call)(sbuf, rbuf, n, type, op, comm);
    case BROADCAST:
      if (req) return reinterpret_cast<int (*)(void*, int, H, int, H, H*)>(f->call)(rbuf, n, type, f->root, comm, req);
      return reinterpret_cast<int (*)(void*, int, H, int, H)>(f->call)(rbuf, n, type, f->root, comm);
    default:   // ALLGATHER, ALLTOALL: the same signature, count per rank
      if (req)
        return reinterpret_cast<int (*)(const void*, int, H, void*, int, H, H, H*)>(f->call)(sbuf, n, type, rbuf, n, type, comm, req);
      return reinterpret_cast<int (*)(const void*, int, H, void*, int, H, H)>(f->call)(sbuf, n, type, rbuf, n, type, comm);
  }
}

inline int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// blocking: (0 or the MPI error code); nonblocking: the same, and *pending with the request's
// handle when a burst of tests -- then, for yield_ns, tests between sched_yield calls (progress.py's
// pace, without the interpreter between the tests) -- did not see it finish; *yielded when that
// yield phase ran (not where the wait goes on blocking inside the library: progress.Waiter)
template <typename H>
int run_mpi(Fast* f, void* sbuf, void* rbuf, int64_t s, bool* pending, int64_t* handle, bool* yielded) {
  int rc = 0;
  if (f->blocking) {
    int64_t* g = f->guard.p();
    g[1] = s;
    __atomic_store_n(&g[0], f->token, __ATOMIC_RELEASE);
    Py_BEGIN_ALLOW_THREADS
    rc = issue<H>(f, sbuf, rbuf, static_cast<H*>(nullptr));
    Py_END_ALLOW_THREADS
    __atomic_store_n(&g[0], int64_t(0), __ATOMIC_RELEASE);
    return rc;
  }
  H req{};
  rc = issue<H>(f, sbuf, rbuf, &req);
  if (rc) return rc;
  int flag = 0;
  auto test = reinterpret_cast<int (*)(H*, int*, void*)>(f->test);
  Py_BEGIN_ALLOW_THREADS
  const int64_t* pace = f->pace.p();
  const int64_t spins = __atomic_load_n(&pace[0], __ATOMIC_RELAXED);
  *yielded = f->yield_ns > 0 && !(f->waits_block && __atomic_load_n(&pace[1], __ATOMIC_RELAXED));
  for (int64_t i = 0; i < spins && !flag && rc == 0; ++i) rc = test(&req, &flag, f->status);
  if (!flag && rc == 0 && *yielded) {
    const int64_t until = now_ns() + f->yield_ns;
    for (unsigned i = 1; !flag && rc == 0; ++i) {
      sched_yield();
      rc = test(&req, &flag, f->status);
      if (!(i & 15) && now_ns() > until) break;   // the clock every 16th yield, as progress.Backoff reads it
    }
  }
  Py_END_ALLOW_THREADS
  if (rc == 0 && !flag) {
    *pending = true;
    *handle = int64_t((intptr_t)req);   // as mpi4py's Request.fromhandle takes it
  }
  return rc;
}

// run(plan, x, out, op, algo, inplace) -> the output array; None: the plan does not fit (nothing
// ran); (0, code): the MPI library returned an error; (1, handle): started, still running (the
// caller waits for the request against the deadline); (2, handle): the same after the yield phase
PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "fastcoll.run takes (plan, x, out, op, algo, inplace)");
    return nullptr;
  }
  if (args[0] == Py_None) Py_RETURN_NONE;
  auto* f = static_cast<Fast*>(PyCapsule_GetPointer(args[0], CAPSULE));
  if (!f) return nullptr;
  PyObject *x = args[1], *out = args[2];
  if (args[3] != f->op_obj || args[4] != f->algo_obj) Py_RETURN_NONE;
  void *sbuf, *rbuf;
  PyObject* dst;
  if (f->verb == ALLREDUCE || f->verb == BROADCAST) {
    bool in_place = out == Py_None ? args[5] == Py_True : out == x;
    if (in_place) {
      if (!fits(f, x, f->ndim, f->dims, true)) Py_RETURN_NONE;
      dst = x;
      rbuf = data(x);
      sbuf = f->in_place;
    } else {
      if (f->verb == BROADCAST || out == Py_None || !fits(f, x, f->ndim, f->dims, false) ||
          !fits(f, out, f->ndim, f->dims, true))
        Py_RETURN_NONE;
      dst = out;
      sbuf = data(x);
      rbuf = data(out);
    }
  } else {
    if (out == Py_None || out == x || !fits(f, x, f->ndim, f->dims, false) ||
        !fits(f, out, f->out_ndim, f->out_dims, true))
      Py_RETURN_NONE;
    dst = out;
    sbuf = data(x);
    rbuf = data(out);
  }
  const int64_t s = ++f->seq.p()[0];
  int64_t* b = f->board.p();
  b[1] = f->code;
  b[0] = s;
  bool pending = false, yielded = false;
  int64_t handle = 0;
  int rc = f->hbytes == 4 ? run_mpi<int32_t>(f, sbuf, rbuf, s, &pending, &handle, &yielded)
                          : run_mpi<void*>(f, sbuf, rbuf, s, &pending, &handle, &yielded);
  if (rc) return Py_BuildValue("(ii)", 0, rc);
  if (pending) return Py_BuildValue("(iL)", yielded ? 2 : 1, static_cast<long long>(handle));
  Py_INCREF(dst);
  return dst;
}

PyMethodDef RUN_DEF = {"fastcoll_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&run)),
                       METH_FASTCALL, "run(plan, x, out, op, algo, inplace): a planned collective in C (fastcoll.cpp)"};

py::object make(int verb, bool blocking, int hbytes, uintptr_t call, uintptr_t test, int64_t comm, int64_t type,
                int64_t op, int root, int64_t in_place, py::dtype descr, py::tuple shape, py::tuple out_shape,
                int64_t count, py::object op_obj, py::object algo_obj, py::object seq, py::object board, int64_t code,
                py::object guard, int64_t token, py::object pace, bool waits_block, double yield_s) {
  if (verb < ALLREDUCE || verb > ALLTOALL) throw py::value_error("fastcoll: unknown verb");
  if (hbytes != 4 && hbytes != 8) throw py::value_error("fastcoll: MPI handles of " + std::to_string(hbytes) + " bytes");
  if (count < 0 || count > INT_MAX) throw py::value_error("fastcoll: count out of int range");
  if (shape.size() > MAXDIM || out_shape.size() > MAXDIM) throw py::value_error("fastcoll: too many dimensions");
  auto* f = new Fast();
  try {
    f->verb = verb;
    f->blocking = blocking;
    f->hbytes = hbytes;
    f->call = reinterpret_cast<void*>(call);
    f->test = reinterpret_cast<void*>(test);
    f->comm = comm;
    f->type = type;
    f->op = op;
    f->root = root;
    f->in_place = reinterpret_cast<void*>(static_cast<intptr_t>(in_place));
    f->descr = descr.release().ptr();
    f->op_obj = op_obj.release().ptr();
    f->algo_obj = algo_obj.release().ptr();
    f->ndarray = reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_);
    f->ndim = int(shape.size());
    for (int i = 0; i < f->ndim; ++i) f->dims[i] = shape[i].cast<Py_ssize_t>();
    f->out_ndim = int(out_shape.size());
    for (int i = 0; i < f->out_ndim; ++i) f->out_dims[i] = out_shape[i].cast<Py_ssize_t>();
    f->count = int(count);
    f->code = code;
    f->token = token;
    f->waits_block = waits_block;
    f->yield_ns = yield_s > 0 ? int64_t(std::min(yield_s, 1.0) * 1e9) : 0;   // (at most a second; NaN: none)
    hold(f->seq, seq, 1);
    hold(f->board, board, 2);
    hold(f->guard, guard, 2);
    hold(f->pace, pace, 2);
  } catch (...) {
    release(f);
    throw;
  }
  return py::reinterpret_steal<py::object>(PyCapsule_New(f, CAPSULE, &destroy));
}

}  // namespace

namespace pympar::bind {

void bind_fastcoll(py::module_& m) {
  m.def("fastcoll_make", &make,
        "a planned collective's C form (fastcoll.cpp): verb (0 allreduce, 1 broadcast, 2 allgather, 3 alltoall), "
        "blocking, MPI handle bytes, the library function and MPI_Test addresses, comm/type/op handles, root, "
        "MPI_IN_PLACE, dtype, shape, output shape, count, op and algo objects, the seq, board and guard buffers, "
        "the op code, the guard token, the pace buffer, whether the communicator's waits may block in the library, "
        "seconds of tests between yields before a pending call returns");
  py::object fn = py::reinterpret_steal<py::object>(PyCFunction_New(&RUN_DEF, nullptr));
  if (!fn) throw py::error_already_set();
  m.attr("fastcoll_run") = fn;
}

}  // namespace pympar::bind
