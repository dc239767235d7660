// The intra-op threads of the calling thread: how many threads a CPU kernel's parallel loop
// (at::parallel_for) started from this thread may use.
//
// With PyTorch's OpenMP backend every thread that starts a parallel loop gets its own team of
// at::get_num_threads() threads. A background thread (a non-blocking dump's writer) whose
// torch ops start teams of their own then runs as many threads again as training, on the same
// cores: each training step waits for its threads that lost their core. Giving that thread
// one intra-op thread runs its loops on it alone; other threads keep their count (an OpenMP
// thread count is a per-thread setting, unlike torch.set_num_threads, which is process-wide).
// Where PyTorch was built with MKL (its vector math: exp, log and the like on large tensors),
// MKL's own per-thread count is set too; MKL starts its teams from that count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#if defined(_OPENMP)
#include <omp.h>
#endif

// MKL's per-thread count: its C entry, the count by value (libtorch_cpu exports it where
// PyTorch was built with MKL; the lower-case names are the Fortran entries, which take a
// pointer). A weak reference: null where no loaded library defines it (ELF, Linux only).
#if defined(__linux__)
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));
#endif

namespace demb {
namespace {

int64_t set_thread_intra_op_threads(int64_t threads) {
  TORCH_CHECK_VALUE(threads >= 1, "set_thread_intra_op_threads: threads=", threads,
                    " must be at least 1");
  const int64_t before = at::get_num_threads();  // also the thread's first initialization
#if defined(_OPENMP)
  omp_set_num_threads(static_cast<int>(threads));
#endif
#if defined(__linux__)
  if (MKL_Set_Num_Threads_Local != nullptr) {
    MKL_Set_Num_Threads_Local(static_cast<int>(threads));
  }
#endif
  return before;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CompositeImplicitAutograd, m) {
  // no tensors: one kernel for every backend
  m.impl("set_thread_intra_op_threads", &set_thread_intra_op_threads);
}

}  // namespace demb
