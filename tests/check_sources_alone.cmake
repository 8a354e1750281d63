# CTest consumer.sources_alone: every source of mha's libraries (mha::mha,
# mha::parity, mha::train: every src/**/*.cpp) compiles on its own, as a
# build of mha without the unity build compiles it (a project's
# add_subdirectory, a distribution's package): no source may lean on an
# include of the one before it in a unity batch. Configures mha in WORK_DIR
# as its own project with CXX, one translation unit per source
# (CMAKE_UNITY_BUILD=OFF), unoptimised (build type None), the libraries
# only, and builds them; then checks that each src/**/*.cpp has its own
# object. The precompiled <torch/torch.h> stays, as in every build of mha.
# Without warnings (-w): they are the main build's (MHA_WARNINGS, MHA_WERROR),
# and another compiler's would only bury an error in the log.
# Variables: SOURCE_DIR (mha's), WORK_DIR, GENERATOR, TORCH_DIR, CXX.
file(REMOVE_RECURSE ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/consumer/run_checked.cmake)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX} -DTorch_DIR=${TORCH_DIR} -DCMAKE_CXX_FLAGS=-w
    -DCMAKE_BUILD_TYPE=None -DCMAKE_UNITY_BUILD=OFF -DMHA_BUILD_TESTS=OFF
    -DMHA_BUILD_TOOLS=OFF -DMHA_INSTALL=OFF)
run(${CMAKE_COMMAND} --build ${WORK_DIR})
file(GLOB_RECURSE sources RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/*.cpp)
file(GLOB_RECURSE objects RELATIVE ${WORK_DIR} ${WORK_DIR}/*.o)
set(missing "")
foreach(source ${sources})
  if(NOT objects MATCHES "(^|;)CMakeFiles/[^/;]+\\.dir/${source}\\.o(;|$)")
    list(APPEND missing ${source})
  endif()
endforeach()
if(missing OR objects MATCHES "Unity/")
  message(FATAL_ERROR "not compiled on its own: ${missing}\nobjects: ${objects}")
endif()
list(LENGTH sources count)
message(STATUS "${count} sources compiled on their own by ${CXX}")
