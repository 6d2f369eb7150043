# Builds a Clang precompiled header of HEADER (an absolute path outside the checkout, e.g. torch's
# <torch/torch.h>) with exactly the flags CMake compiles REFERENCE with (the object path that
# compile_commands.json names after -o), into OUTPUT, writing a depfile DEPFILE.
#   cmake -DCOMMANDS=<compile_commands.json> -DREFERENCE=<object> -DHEADER=<header> -DOUTPUT=<pch>
#         -DDEPFILE=<file> -P ClangPch.cmake
# Why not CMake's own precompiled headers: Clang writes the header's path, the output directory and
# the working directory into the .pch, and CMake's header lives in the build tree, so the .pch of two
# checkouts differ and ccache, which hashes the .pch into every compile that uses it, can never serve
# one checkout from another's objects. Built here from a header outside the checkout, in that
# header's directory, to standard output and without timestamps, the .pch is the same bytes in every
# checkout of one machine. Like CMake's, it instantiates the templates its header uses
# (-fpch-instantiate-templates), which every TU would otherwise do again. OUTPUT is replaced only when its bytes change, so an unchanged header
# rebuilds nothing after a re-configure.
cmake_minimum_required(VERSION 3.25)
foreach(var COMMANDS REFERENCE HEADER OUTPUT DEPFILE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "ClangPch.cmake: -D${var}=... is required")
  endif()
endforeach()

file(READ "${COMMANDS}" json)
string(JSON count LENGTH "${json}")
math(EXPR last "${count} - 1")
set(command "")
foreach(i RANGE ${last})
  string(JSON entry GET "${json}" ${i} command)
  string(FIND "${entry}" " -o ${REFERENCE} " at)
  if(at GREATER -1)
    set(command "${entry}")
    break()
  endif()
endforeach()
if(command STREQUAL "")
  message(FATAL_ERROR "ClangPch.cmake: no compile command for ${REFERENCE} in ${COMMANDS}")
endif()

separate_arguments(args UNIX_COMMAND "${command}")
set(flags "")
set(skip FALSE)
foreach(a IN LISTS args)
  if(skip)
    set(skip FALSE)
  elseif(a STREQUAL "-o" OR a STREQUAL "-c" OR a STREQUAL "-MF" OR a STREQUAL "-MT")
    set(skip TRUE)  # the reference's own output, source and depfile
  elseif(NOT a MATCHES "^-M[DT]$")
    list(APPEND flags "${a}")
  endif()
endforeach()

get_filename_component(header_dir "${HEADER}" DIRECTORY)
get_filename_component(output_dir "${OUTPUT}" DIRECTORY)
file(MAKE_DIRECTORY "${output_dir}")
string(RANDOM LENGTH 8 tag)
set(tmp "${OUTPUT}.${tag}.tmp")
execute_process(
  COMMAND ${flags} -x c++-header "${HEADER}" -Xclang -emit-pch -Xclang -fno-pch-timestamp -fpch-instantiate-templates
          -MD -MF "${DEPFILE}" -MT "${OUTPUT}" -o -
  WORKING_DIRECTORY "${header_dir}"
  OUTPUT_FILE "${tmp}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(REMOVE "${tmp}")
  message(FATAL_ERROR "ClangPch.cmake: precompiling ${HEADER} failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${tmp}" "${OUTPUT}" RESULT_VARIABLE differ
                OUTPUT_QUIET ERROR_QUIET)
if(differ EQUAL 0)
  file(REMOVE "${tmp}")
else()
  file(RENAME "${tmp}" "${OUTPUT}")
endif()
