# Note [Finding NCCL]
# The direct NCCL back end (runtime/cuda/nccl_communicator.cc) is compiled in every CUDA build
# where NCCL is found: NCCL_ROOT (cache or environment), the CUDA toolkit's include and library
# directories, or the `nvidia-nccl-cu13` pip wheel in the Python that builds us (torch's CUDA
# wheels depend on it; tools/setup.sh installs it when nvcc is present). Without NCCL the build
# goes on without that back end (CreateNcclCommunicator returns FailedPrecondition) and says why.
set(PS_NCCL_ENABLED OFF)
if(PS_CUDA_ENABLED)
  set(_ps_nccl_hints)
  if(NCCL_ROOT)
    list(APPEND _ps_nccl_hints "${NCCL_ROOT}")
  elseif(DEFINED ENV{NCCL_ROOT})
    list(APPEND _ps_nccl_hints "$ENV{NCCL_ROOT}")
  endif()
  set(_ps_python "${Python_EXECUTABLE}")
  if(NOT _ps_python AND EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    set(_ps_python "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  endif()
  if(_ps_python)
    execute_process(
      COMMAND "${_ps_python}" -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
      OUTPUT_VARIABLE _ps_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _ps_wheel_result)
    if(_ps_wheel_result EQUAL 0 AND _ps_wheel)
      list(APPEND _ps_nccl_hints "${_ps_wheel}")
    endif()
  endif()
  find_path(PS_NCCL_INCLUDE_DIR nccl.h
            HINTS ${_ps_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(PS_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${_ps_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(PS_NCCL_INCLUDE_DIR AND PS_NCCL_LIBRARY)
    set(PS_NCCL_ENABLED ON)
    get_filename_component(PS_NCCL_LIBRARY_DIR "${PS_NCCL_LIBRARY}" DIRECTORY)
    message(STATUS "NCCL back end: ${PS_NCCL_LIBRARY} (headers ${PS_NCCL_INCLUDE_DIR})")
  else()
    message(STATUS "NCCL back end disabled: no nccl.h / libnccl found in NCCL_ROOT, the CUDA "
                   "toolkit or the nvidia-nccl-cu13 wheel of '${_ps_python}' "
                   "(pip install nvidia-nccl-cu13, or set NCCL_ROOT)")
  endif()
else()
  message(STATUS "NCCL back end disabled: CUDA is off")
endif()
