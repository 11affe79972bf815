// The Python-side owner of a ChunkManager, shared by init_chunk.cc and init_comm.cc.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>

#include "absl/synchronization/mutex.h"
#include "chunk/chunk_manager.h"

namespace ps::bindings {

// The manager is not thread-safe, and long calls release the GIL, so each manager carries a
// mutex taken (after the GIL is dropped) by every call.
class PyChunkManager {
 public:
  explicit PyChunkManager(std::unique_ptr<ChunkManager> manager) : manager_(std::move(manager)) {}

  template <typename F>
  auto Run(F&& f) {
    pybind11::gil_scoped_release release;
    absl::MutexLock lock(&mutex_);
    return f(Get());
  }

  // Runs f(manager) unless Close() ran; returns whether it ran. For objects that hold raw
  // pointers into the manager and must let go of them while it lives (PyGroupCollectives).
  template <typename F>
  bool RunIfOpen(F&& f) {
    pybind11::gil_scoped_release release;
    absl::MutexLock lock(&mutex_);
    if (manager_ == nullptr) return false;
    f(*manager_);
    return true;
  }

  // For calls that run Python code (callbacks): the GIL stays held.
  template <typename F>
  auto RunHoldingGil(F&& f) {
    absl::MutexLock lock(&mutex_);
    return f(Get());
  }

  // Frees every chunk now, whoever still references this object (a traceback may hold it
  // long after the engine let go); later calls raise RuntimeError.
  void Close() {
    std::unique_ptr<ChunkManager> doomed;
    {
      pybind11::gil_scoped_release release;
      absl::MutexLock lock(&mutex_);
      doomed = std::move(manager_);
    }
    pybind11::gil_scoped_release release;
    doomed.reset();
  }

 private:
  ChunkManager& Get() {
    if (manager_ == nullptr) {
      throw std::runtime_error("the chunk manager was closed (model.destroy()); build a new "
                               "engine with patrickstar.initialize()");
    }
    return *manager_;
  }

  absl::Mutex mutex_;
  std::unique_ptr<ChunkManager> manager_;
};

}  // namespace ps::bindings
