# The device backends (cuda, hip), from the one kernel source kern/kernels.h.
#   SHARD_CUDA=AUTO|ON|OFF: nvcc (CMAKE_CUDA_COMPILER, else PATH, else /usr/local/cuda/bin) and
#   cuda.h; the kernels for sm_80 and sm_90 (+ PTX), embedded in the binary; libcuda is opened
#   at run time. SHARD_HIP=AUTO|ON|OFF: hipcc, for SHARD_HIP_ARCHS.
# Both compile with no FMA contraction and IEEE division and square root (the host code's
# -ffp-contract=off), so a kernel's result equals the host backend's bit for bit.
set(SHARD_CUDA AUTO CACHE STRING "build the CUDA backend: AUTO, ON or OFF")
set(SHARD_HIP AUTO CACHE STRING "build the HIP backend: AUTO, ON or OFF")
set(SHARD_CUDA_ARCHS "80;90" CACHE STRING "CUDA architectures of the kernels (and PTX of the last)")
set(SHARD_HIP_ARCHS "gfx90a;gfx940" CACHE STRING
    "AMD GPU architectures of the HIP kernels (gfx90a: MI250X; gfx940: MI300, the newest Debian's hipcc 5.2 knows)")
# IN (a built device image) as OUT.c, a C array NAME that sd_gpu compiles in
function(sd_embed in name)
  add_custom_command(
    OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/${name}.c
    COMMAND ${CMAKE_COMMAND} -DIN=${in} -DOUT=${CMAKE_CURRENT_BINARY_DIR}/${name}.c -DNAME=${name}
            -P ${CMAKE_CURRENT_SOURCE_DIR}/embed.cmake
    DEPENDS ${in} ${CMAKE_CURRENT_SOURCE_DIR}/embed.cmake
    VERBATIM)
  target_sources(sd_gpu PRIVATE ${CMAKE_CURRENT_BINARY_DIR}/${name}.c)
endfunction()

set(kern_src ${CMAKE_CURRENT_SOURCE_DIR}/kern/kernels.h ${CMAKE_CURRENT_SOURCE_DIR}/kern/compat.h
    ${CMAKE_CURRENT_SOURCE_DIR}/kern/params.h)

if(NOT SHARD_CUDA STREQUAL "OFF")
  find_program(SHARD_NVCC nvcc HINTS ${CMAKE_CUDA_COMPILER} PATHS /usr/local/cuda/bin)
  find_path(SHARD_CUDA_INCLUDE cuda.h HINTS ${SHARD_NVCC}/../../include
            PATHS /usr/local/cuda/include)
  if(SHARD_NVCC AND SHARD_CUDA_INCLUDE)
    set(gencode)
    foreach(a ${SHARD_CUDA_ARCHS})
      list(APPEND gencode -gencode arch=compute_${a},code=sm_${a})
    endforeach()
    list(GET SHARD_CUDA_ARCHS -1 last)
    list(APPEND gencode -gencode arch=compute_${last},code=compute_${last})
    set(werror)
    if(SHARD_WERROR)
      set(werror -Werror all-warnings -Xcompiler -Werror)
    endif()
    add_custom_command(
      OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/kernels.fatbin
      COMMAND ${SHARD_NVCC} --fatbin ${gencode} -O3 --fmad=false -prec-div=true -prec-sqrt=true
              -ftz=false -Xcompiler -Wall,-Wextra ${werror} -I${CMAKE_CURRENT_SOURCE_DIR}
              -o ${CMAKE_CURRENT_BINARY_DIR}/kernels.fatbin
              ${CMAKE_CURRENT_SOURCE_DIR}/kern/kernels.cu
      DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/kern/kernels.cu ${kern_src}
      COMMENT "nvcc: the device kernels for sm_${SHARD_CUDA_ARCHS}" VERBATIM)
    sd_embed(${CMAKE_CURRENT_BINARY_DIR}/kernels.fatbin sd_cuda_fatbin)
    target_sources(sd_gpu PRIVATE cuda.c)
    set_source_files_properties(cuda.c PROPERTIES INCLUDE_DIRECTORIES ${SHARD_CUDA_INCLUDE}
                                OBJECT_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/dev.c)
    target_compile_definitions(sd_gpu PUBLIC SHARD_HAVE_CUDA)
    target_link_libraries(sd_gpu PUBLIC ${CMAKE_DL_LIBS})
    message(STATUS "shardd: CUDA backend with ${SHARD_NVCC} (sm ${SHARD_CUDA_ARCHS})")
  elseif(SHARD_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARD_CUDA=ON: nvcc or cuda.h not found (set CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "shardd: no nvcc: the CUDA backend is not built")
  endif()
endif()

if(NOT SHARD_HIP STREQUAL "OFF")
  find_program(SHARD_HIPCC hipcc PATHS /opt/rocm/bin)
  find_path(SHARD_HIP_INCLUDE hip/hip_runtime_api.h PATHS /opt/rocm/include)
  if(SHARD_HIPCC AND SHARD_HIP_INCLUDE)
    string(REPLACE ";" "," hip_archs "${SHARD_HIP_ARCHS}")
    set(werror)
    if(SHARD_WERROR)
      set(werror -Werror)
    endif()
    add_custom_command(
      OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/kernels.hsaco
      COMMAND ${SHARD_HIPCC} --genco --offload-arch=${hip_archs} -O3 -ffp-contract=off
              -fno-fast-math -Wall -Wextra ${werror} -I${CMAKE_CURRENT_SOURCE_DIR}
              -o ${CMAKE_CURRENT_BINARY_DIR}/kernels.hsaco
              ${CMAKE_CURRENT_SOURCE_DIR}/kern/kernels.hip
      DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/kern/kernels.hip ${kern_src}
      COMMENT "hipcc: the device kernels for ${hip_archs}" VERBATIM)
    sd_embed(${CMAKE_CURRENT_BINARY_DIR}/kernels.hsaco sd_hip_code_object)
    target_sources(sd_gpu PRIVATE hip.c)
    set_source_files_properties(hip.c PROPERTIES INCLUDE_DIRECTORIES ${SHARD_HIP_INCLUDE})
    set_source_files_properties(hip.c cuda.c PROPERTIES OBJECT_DEPENDS
                                ${CMAKE_CURRENT_SOURCE_DIR}/dev.c)
    target_compile_definitions(sd_gpu PUBLIC SHARD_HAVE_HIP)
    target_link_libraries(sd_gpu PUBLIC ${CMAKE_DL_LIBS})
    message(STATUS "shardd: HIP backend with ${SHARD_HIPCC} (${hip_archs})")
  elseif(SHARD_HIP STREQUAL "ON")
    message(FATAL_ERROR "SHARD_HIP=ON: hipcc or hip/hip_runtime_api.h not found")
  else()
    message(STATUS "shardd: no hipcc: the HIP backend is not built")
  endif()
endif()
