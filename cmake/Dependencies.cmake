# Third-party dependencies: Debian packages (yaml-cpp, fmt, cereal, CLI11, nlohmann-json, protobuf,
# GoogleTest) and libtorch from PyPI's torch wheel (CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path).
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(Threads REQUIRED)
find_package(ZLIB)  # optional: without it, gzip'd data files are read through `gzip -dc`

# CUDA: compile kernels whenever nvcc is present, so CPU-only machines (CI) still compile and link
# every kernel. Torch's config looks for the toolkit itself when the libtorch was built with CUDA.
include(CheckLanguage)
set(STROBE_WITH_CUDA OFF)
if(STROBE_CUDA)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_ARCHITECTURES ${STROBE_CUDA_ARCHITECTURES})
    set(STROBE_WITH_CUDA ON)
  endif()
endif()

# PyTorch's Caffe2 config otherwise warns about missing kineto/nvtx; nothing here needs them.
set(CAFFE2_USE_CUDNN ON CACHE BOOL "")
find_package(Torch REQUIRED)
# Torch's config appends -gencode flags for every architecture of the wheel (compute_50 among them,
# which nvcc 13 rejects); our kernels are built for STROBE_CUDA_ARCHITECTURES only.
string(REGEX REPLACE "-gencode[= ]arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")
# The wheel's libtorch has CUDA when it ships libtorch_cuda; only then the torch-CUDA glue builds.
set(STROBE_TORCH_HAS_CUDA OFF)
if(TARGET torch_cuda OR EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so")
  set(STROBE_TORCH_HAS_CUDA ON)
endif()
message(STATUS "Strobe: CUDA kernels ${STROBE_WITH_CUDA}, libtorch with CUDA ${STROBE_TORCH_HAS_CUDA}")

# Locate the python that carries torch, for comparison tests (torchvision, torchmetrics, tensorboard).
if(NOT STROBE_PYTHON)
  find_program(STROBE_PYTHON_FOUND NAMES python3)
  set(STROBE_PYTHON ${STROBE_PYTHON_FOUND})
endif()

# Every torch target (libraries and executables) reuses a precompiled header of <torch/torch.h>
# (strobe/CMakeLists.txt): strobe_pch for the product, strobe_pch_unoptimized for the tests and
# their helper programs, which compile at -O0 (their own code only orchestrates calls into the
# optimised libraries; -O0 halves their compile time with GCC and quarters it with Clang).
# CMAKE_POSITION_INDEPENDENT_CODE gives executables -fPIE and libraries -fPIC, and GCC rejects a
# PCH built with the other setting ("created and used with different settings of -fpie") and
# silently compiles <torch/torch.h> again in every TU: every user compiles with -fPIC (an
# executable is still linked as a PIE). Any other difference (a -D the header was not built with,
# another -O) is caught by -Werror=invalid-pch, which turns GCC's "not used because ..." into a
# build error (Clang refuses a .pch that does not match on its own).
# strobe_use_pch(<target> [UNOPTIMIZED])
function(strobe_use_pch target)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(${target} PRIVATE -fPIC -Werror=invalid-pch)
  set(pch strobe_pch)
  if("UNOPTIMIZED" IN_LIST ARGN)
    target_compile_options(${target} PRIVATE -O0)
    set(pch strobe_pch_unoptimized)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # strobe/CMakeLists.txt: a .pch built by cmake/ClangPch.cmake. A TU's depfile lists the
    # headers the .pch holds, and the .pch changes only with them or with the flags, which change the
    # TU's own command too: ordering the .pch first is all a TU needs.
    get_target_property(file ${pch} STROBE_PCH_FILE)
    target_compile_options(${target} PRIVATE -Winvalid-pch -include-pch ${file})
    add_dependencies(${target} ${pch}_header)
  else()
    target_precompile_headers(${target} REUSE_FROM ${pch})
  endif()
endfunction()
