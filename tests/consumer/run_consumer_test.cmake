# Configures, builds and runs a consumer project. With MHA_BINARY_DIR, first
# installs that mha build into a scratch prefix for find_package(mha), and
# also compiles the consumer's main.cpp with nothing but the flags of
# `pkg-config --cflags --libs mha`; with MHA_SOURCE_DIR, the consumer builds
# mha itself with add_subdirectory. With CTEST (the ctest program), the
# consumer's own CTest tests are run instead of its programs (examples/).
# Variables: MHA_BINARY_DIR or MHA_SOURCE_DIR, CONSUMER_SOURCE_DIR, WORK_DIR,
# GENERATOR, TORCH_DIR (LibTorch's CMake folder), CXX (the compiler);
# optional CTEST, CONSUMER_OPTIONS: more -D options for the consumer's
# configure, separated by '|', and BUILD_TYPE (default Release).
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()
set(extra -DTorch_DIR=${TORCH_DIR} -DCMAKE_CXX_COMPILER=${CXX})
if(CONSUMER_OPTIONS)
  string(REPLACE "|" ";" options "${CONSUMER_OPTIONS}")
  list(APPEND extra ${options})
endif()
if(MHA_BINARY_DIR)
  run(${CMAKE_COMMAND} --install ${MHA_BINARY_DIR} --prefix ${WORK_DIR}/prefix)
  list(APPEND extra -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
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
if(MHA_BINARY_DIR)
  run(${WORK_DIR}/build/consumer_train)
  # The installed mha.pc, found through PKG_CONFIG_PATH.
  file(GLOB_RECURSE pc_files ${WORK_DIR}/prefix/*/mha.pc)
  list(LENGTH pc_files pc_count)
  if(NOT pc_count EQUAL 1)
    message(FATAL_ERROR "expected one installed mha.pc, found: ${pc_files}")
  endif()
  get_filename_component(pc_dir ${pc_files} DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} ${pc_dir})
  execute_process(COMMAND pkg-config --cflags --libs mha
                  OUTPUT_VARIABLE pc_flags OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags --libs mha failed (${rc})")
  endif()
  separate_arguments(pc_flags UNIX_COMMAND "${pc_flags}")
  # No -std here: mha.pc's Cflags name the standard mha was built with.
  run(${CXX} ${CONSUMER_SOURCE_DIR}/main.cpp ${pc_flags}
      -o ${WORK_DIR}/consumer_pkg_config)
  run(${WORK_DIR}/consumer_pkg_config)
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
