# Unity builds: a target's .cpp files compiled in batches, each batch one translation unit, so that
# <torch/torch.h> (precompiled header or not) is loaded and its templates instantiated once per batch
# instead of once per file (3.5-7x less CPU where measured).
#
# CMake's own UNITY_BUILD includes the sources by absolute path, so a batch's text differs between
# two checkouts and ccache can never hit across them (see the ccache launcher in CMakeLists.txt).
# These batches include their sources by paths relative to the batch file, which is the same in every
# checkout whose build tree sits at the same place inside it (build/, build-gpu/, ...).
#
# Batches never span two directories, so a new file shifts the batches of its own directory only.
# Files of one batch share one translation unit: names at namespace scope (anonymous namespaces and
# statics included) must be unique within a directory, and no file may leave a macro or a
# `using namespace` behind for the next.
set(STROBE_UNITY_BATCH 8 CACHE STRING "Source files per unity batch (1: every file on its own)")

# strobe_unity(<out-var> <name> <source>...): the batch files (or the sources themselves when
# STROBE_UNITY_BATCH is 1) for a target's sources. A source with compile properties of its own
# (include directories, definitions) must be left out of the list and added to the target as itself.
function(strobe_unity out name)
  if(STROBE_UNITY_BATCH LESS_EQUAL 1)
    set(${out} ${ARGN} PARENT_SCOPE)
    return()
  endif()
  set(files ${ARGN})
  list(SORT files)  # files of one directory next to each other
  list(APPEND files "")  # a last, empty entry flushes the last batch
  set(result)
  set(batch)
  set(batch_dir)
  set(index 0)
  foreach(f IN LISTS files)
    get_filename_component(d "${f}" DIRECTORY)
    list(LENGTH batch n)
    if(n GREATER 0 AND (n EQUAL STROBE_UNITY_BATCH OR NOT d STREQUAL batch_dir))
      if(n EQUAL 1)
        list(APPEND result ${batch})
      else()
        strobe_unity_write_(${CMAKE_BINARY_DIR}/unity/${name}/${name}_${index}.cpp ${batch})
        list(APPEND result ${CMAKE_BINARY_DIR}/unity/${name}/${name}_${index}.cpp)
        math(EXPR index "${index} + 1")
      endif()
      set(batch)
    endif()
    list(APPEND batch ${f})
    set(batch_dir "${d}")
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

function(strobe_unity_write_ file)
  get_filename_component(dir ${file} DIRECTORY)
  set(text "// Unity batch written by cmake/Unity.cmake: do not edit.\n")
  foreach(f ${ARGN})
    file(RELATIVE_PATH rel ${dir} ${f})
    string(APPEND text "#include \"${rel}\"\n")
  endforeach()
  # Rewritten only when it changes: an unchanged batch is not compiled again after a re-configure.
  file(CONFIGURE OUTPUT ${file} CONTENT "${text}" @ONLY)
endfunction()
