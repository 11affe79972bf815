# Note [PS_WITH_CUDA]
# AUTO turns CUDA on whenever nvcc is found, so that a machine with the toolkit but no GPU (CI)
# still compiles every .cu and runtime/cuda source: a build break shows up there, not on the GPU
# machine. Whether a GPU is present is a run-time question (ps::cuda::DeviceCount()); tests
# that need one skip with a reason.
include(CheckLanguage)
set(PS_CUDA_ENABLED OFF)
if(PS_WITH_CUDA STREQUAL "AUTO" OR PS_WITH_CUDA)
  if(NOT PS_WITH_CUDA STREQUAL "AUTO" AND NOT PS_WITH_CUDA)
    # OFF, FALSE, 0 ...
  else()
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      # Hopper is the GPU we run on; 80 keeps an Ampere build honest.
      set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING "CUDA architectures")
    endif()
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(PS_CUDA_ENABLED ON)
    elseif(NOT PS_WITH_CUDA STREQUAL "AUTO")
      message(FATAL_ERROR "PS_WITH_CUDA=${PS_WITH_CUDA} but no CUDA compiler was found; "
                          "set CMAKE_CUDA_COMPILER or PS_WITH_CUDA=OFF")
    endif()
  endif()
endif()
if(PS_CUDA_ENABLED)
  set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 does not know nvcc's C++20 flag
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "CUDA enabled: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}")
else()
  message(STATUS "CUDA disabled (PS_WITH_CUDA=${PS_WITH_CUDA})")
endif()
