# One ctest test per GoogleTest suite of a test executable: `<Suite>` runs `exe --gtest_filter=<Suite>.*`,
# every case of the suite in one process. A process that loads libtorch and the CUDA libraries takes
# ~0.4 s to start on a 2-core machine, so one process per case spent ~4 of the CPU suite's 18 CPU
# minutes starting 540 processes; one per suite starts ~130. GoogleTest names the failing case in
# the suite's output (ctest --output-on-failure prints it). The CUDA executables keep one test per
# case (gtest_discover_tests): on a GPU machine a case is the unit one reruns.
#
# Like gtest_discover_tests, the suites are listed after each build of the executable (so a new TEST
# needs no configure) into a file ctest includes.
#
#   strobe_add_gtest_suites(TARGET LABELS <labels> COST_PER_TEST <seconds> ENV <VAR=value>...
#                           [RESOURCE_LOCK <name>])
#
# RESOURCE_LOCK: the executable's suites never run beside each other (ctest's RESOURCE_LOCK); the
# tests that fork ranks with a rendezvous and a timeout of a few seconds take one, so two such
# suites do not starve each other's ranks on a 2-core machine.
#
# COST: where ctest has no timings of its own yet (a fresh build tree), a suite's cost is its number
# of cases times COST_PER_TEST, so the long suites start first. A suite runs through gtest_suite.sh:
# skipped (exit 77) only when every case skipped; a failing case always fails it.
if(CMAKE_SCRIPT_MODE_FILE)
  # Script mode (the POST_BUILD step): list the executable's suites and write the ctest file.
  string(REPLACE "|" ";" env "${ENV}")
  string(REPLACE "|" ";" labels "${LABELS}")
  set(lock "")
  if(NOT RESOURCE_LOCK STREQUAL "")
    set(lock " RESOURCE_LOCK [=[${RESOURCE_LOCK}]=]")
  endif()
  set(env_args "")
  foreach(v IN LISTS env)
    string(APPEND env_args " [=[${v}]=]")
  endforeach()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${env} ${EXE} --gtest_list_tests
    WORKING_DIRECTORY "${WORKDIR}" OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 120)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${rc}):\n${listing}")
  endif()
  string(REPLACE ";" "\\;" listing "${listing}")  # a '#' comment may hold one (GetParam() = ...)
  string(REGEX REPLACE "\r?\n" ";" lines "${listing}")
  set(content "")
  set(suite "")
  set(count 0)
  macro(flush)
    if(NOT suite STREQUAL "")
      math(EXPR cost "${count} * ${COST_PER_TEST}")
      string(APPEND content
        "add_test([=[${suite}]=] sh [=[${RUNNER}]=] [=[${CMAKE_COMMAND}]=] -E env${env_args} [=[${EXE}]=] "
        "[=[--gtest_filter=${suite}.*]=])\n"
        "set_tests_properties([=[${suite}]=] PROPERTIES LABELS [=[${labels}]=] COST ${cost} "
        "WORKING_DIRECTORY [=[${WORKDIR}]=] SKIP_RETURN_CODE 77${lock})\n")
    endif()
  endmacro()
  foreach(line IN LISTS lines)
    if(line MATCHES "^Running main" OR line STREQUAL "")
      continue()
    elseif(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")  # "Suite." or "Prefix/Suite/0.  # TypeParam = ..."
      flush()
      set(suite "${CMAKE_MATCH_1}")
      set(count 0)
    elseif(line MATCHES "^  [^ ]")
      math(EXPR count "${count} + 1")
    endif()
  endforeach()
  flush()
  if(content STREQUAL "")
    message(FATAL_ERROR "${EXE} lists no test suite:\n${listing}")
  endif()
  file(WRITE "${OUT}" "${content}")
  return()
endif()

function(strobe_add_gtest_suites target)
  cmake_parse_arguments(arg "" "COST_PER_TEST;RESOURCE_LOCK" "LABELS;ENV" ${ARGN})
  set(tests_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake)
  set(include_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake)
  string(REPLACE ";" "|" env "${arg_ENV}")
  string(REPLACE ";" "|" labels "${arg_LABELS}")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -DEXE=$<TARGET_FILE:${target}> -DOUT=${tests_file} "-DENV=${env}"
      "-DLABELS=${labels}" -DCOST_PER_TEST=${arg_COST_PER_TEST} -DWORKDIR=${PROJECT_BINARY_DIR}
      -DRUNNER=${CMAKE_CURRENT_FUNCTION_LIST_DIR}/gtest_suite.sh "-DRESOURCE_LOCK=${arg_RESOURCE_LOCK}"
      -P ${CMAKE_CURRENT_FUNCTION_LIST_FILE}
    BYPRODUCTS ${tests_file} VERBATIM)
  file(WRITE ${include_file}
    "if(EXISTS [=[${tests_file}]=])\n  include([=[${tests_file}]=])\n"
    "else()\n  add_test([=[${target}_NOT_BUILT]=] [=[${target}_NOT_BUILT]=])\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()
