// The CPU kernels' thread pool and a parallel-for over blocks.
//
// The pool is created at first use with one thread per core the process may run on
// (ps::UsableCores()), or PS_KERNEL_THREADS when set. ParallelFor runs on the calling thread
// plus up to (threads - 1) pool workers, which take block indices from a shared counter so that
// slower threads (a core shared with other work) take fewer blocks.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/types/span.h"

namespace ps::kernels {

// Threads the kernels use (caller included).
int KernelThreads();
// Sets it for later calls (<= 0: back to the default); calls already running keep their pool.
void SetKernelThreads(int threads);

// Calls fn(block) once for every block in [0, num_blocks), spread over KernelThreads() threads;
// returns when all are done (Note [Helpers that start late] in parallel.cc: the caller works
// too and never waits for a helper that has not started, so calls may nest).
void ParallelFor(int64_t num_blocks, const std::function<void(int64_t)>& fn);

// Cuts chunk c of counts[c] elements into blocks of `block_elements` at fixed offsets (0,
// block_elements, ...) and calls fn(c, block, begin, end) for every block of every chunk with
// ParallelFor; `block` numbers the blocks of all chunks in chunk then offset order. All chunks'
// blocks share one queue, so small chunks balance too. Returns the number of blocks.
int64_t NumChunkBlocks(absl::Span<const int64_t> counts, int64_t block_elements);
void ParallelForChunkBlocks(
    absl::Span<const int64_t> counts, int64_t block_elements,
    const std::function<void(size_t chunk, int64_t block, int64_t begin, int64_t end)>& fn);

}  // namespace ps::kernels
