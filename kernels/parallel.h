// The CPU kernels' thread pool and a parallel-for over blocks.
//
// The pool is created at first use with one thread per core the process may run on
// (ps::UsableCores()), or PS_KERNEL_THREADS when set. ParallelFor runs on the calling thread
// plus up to (threads - 1) pool workers, which take block indices from a shared counter so that
// slower threads (a core shared with other work) take fewer blocks.
#pragma once

#include <cstdint>
#include <functional>

namespace ps::kernels {

// Threads the kernels use (caller included).
int KernelThreads();
// Sets it for later calls (<= 0: back to the default). Must not race with running kernels.
void SetKernelThreads(int threads);

// Calls fn(block) once for every block in [0, num_blocks), spread over KernelThreads() threads;
// returns when all are done. fn must not call ParallelFor itself.
void ParallelFor(int64_t num_blocks, const std::function<void(int64_t)>& fn);

}  // namespace ps::kernels
