# CTest consumer.pkg_config: compiles and links a consumer's main.cpp with
# nothing but the flags of `pkg-config --cflags --libs mha`, the mha.pc of an
# installed mha found through PKG_CONFIG_PATH, and runs it.
# Variables: MHA_PREFIX (the installed mha: package.install's), SOURCE (the
# program), CXX (the compiler), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
file(GLOB_RECURSE pc_files ${MHA_PREFIX}/*/mha.pc)
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
run(${CXX} ${SOURCE} ${pc_flags} -o ${WORK_DIR}/consumer_pkg_config)
run(${WORK_DIR}/consumer_pkg_config)
