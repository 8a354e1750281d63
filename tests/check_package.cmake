# Builds the Debian package of this build with CPack (cpack -G DEB) and checks
# it: its name and version, that Depends names Debian's LibTorch and
# OpenBLAS packages, and that it holds the libraries, the public headers,
# the CMake package, mha.pc and the tools, under /usr.
# Variables: BINARY_DIR (the mha build), WORK_DIR, VERSION (mha's).
file(REMOVE_RECURSE ${WORK_DIR})
function(run out)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE text
                  ERROR_VARIABLE text)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${text}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()
run(_ cpack -G DEB --config ${BINARY_DIR}/CPackConfig.cmake -B ${WORK_DIR})
file(GLOB debs ${WORK_DIR}/mha_${VERSION}_*.deb)
list(LENGTH debs count)
if(NOT count EQUAL 1)
  file(GLOB all ${WORK_DIR}/*)
  message(FATAL_ERROR "expected one mha_${VERSION}_*.deb, found: ${all}")
endif()
run(depends dpkg-deb -f ${debs} Depends)
foreach(package libtorch-dev libopenblas0-pthread)
  if(NOT depends MATCHES "(^|, )${package}")
    message(FATAL_ERROR "Depends lacks ${package}: ${depends}")
  endif()
endforeach()
run(contents dpkg-deb -c ${debs})
foreach(path usr/include/mha/mha.h usr/include/mha/transformer_decoder.h
        "usr/lib/([^ ]*/)?libmha\\.a" "usr/lib/([^ ]*/)?pkgconfig/mha\\.pc"
        "usr/lib/([^ ]*/)?cmake/mha/mha-config\\.cmake" usr/bin/mha-parity
        usr/bin/mha-bench usr/bin/mha-train)
  if(NOT contents MATCHES "\\./${path}\n")
    message(FATAL_ERROR "the package lacks ${path}:\n${contents}")
  endif()
endforeach()
if(contents MATCHES "src/")
  message(FATAL_ERROR "the package holds internal sources:\n${contents}")
endif()
message(STATUS "${debs}: Depends: ${depends}")
