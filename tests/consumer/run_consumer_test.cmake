# Configures, builds and runs a consumer project. With MHA_PREFIX, the
# consumer finds the mha installed there with find_package(mha) (CTest's
# package.install puts this build there, once, for every test that uses
# it); with MHA_SOURCE_DIR, the consumer builds mha itself with
# add_subdirectory. With CTEST (the ctest program), the consumer's own CTest
# tests are run instead of its programs (examples/).
# Variables: MHA_PREFIX or MHA_SOURCE_DIR, CONSUMER_SOURCE_DIR, WORK_DIR,
# GENERATOR, TORCH_DIR (LibTorch's CMake folder), CXX (the compiler);
# optional CTEST, CONSUMER_OPTIONS: more -D options for the consumer's
# configure, separated by '|', and BUILD_TYPE (default Release).
file(REMOVE_RECURSE ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
set(extra -DTorch_DIR=${TORCH_DIR} -DCMAKE_CXX_COMPILER=${CXX})
if(CONSUMER_OPTIONS)
  string(REPLACE "|" ";" options "${CONSUMER_OPTIONS}")
  list(APPEND extra ${options})
endif()
if(MHA_PREFIX)
  if(NOT EXISTS ${MHA_PREFIX}/include/mha/mha.h)
    message(FATAL_ERROR "no mha installed in ${MHA_PREFIX} (CTest's "
                        "package.install, the fixture mha_installed, puts it there)")
  endif()
  list(APPEND extra -DCMAKE_PREFIX_PATH=${MHA_PREFIX})
else()
  list(APPEND extra -DMHA_SOURCE_DIR=${MHA_SOURCE_DIR})
endif()
if(NOT DEFINED BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
    -G ${GENERATOR} -DCMAKE_BUILD_TYPE=${BUILD_TYPE} ${extra})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
if(CTEST)
  execute_process(COMMAND ${CTEST} --output-on-failure --no-tests=error
                  WORKING_DIRECTORY ${WORK_DIR}/build RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the tests of ${CONSUMER_SOURCE_DIR} failed (${rc})")
  endif()
  return()
endif()
run(${WORK_DIR}/build/consumer)
if(MHA_PREFIX)
  run(${WORK_DIR}/build/consumer_train)
else()
  # add_subdirectory(mha) builds what the consumer links (mha::mha) and
  # nothing of training or parity.
  file(GLOB_RECURSE built_extras ${WORK_DIR}/build/mha-build/*.o
       ${WORK_DIR}/build/mha-build/*.a)
  list(FILTER built_extras INCLUDE REGEX "mha_(train|parity)")
  if(built_extras)
    message(FATAL_ERROR "add_subdirectory(mha) built more than mha::mha: "
                        "${built_extras}")
  endif()
endif()
