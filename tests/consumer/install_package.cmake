# The fixture mha_installed (CTest package.install): installs an mha build
# into a scratch prefix, once, for the tests that use the installed package
# (consumer.find_package, consumer.pkg_config, examples.installed).
# Variables: MHA_BINARY_DIR (the mha build), PREFIX.
file(REMOVE_RECURSE ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${MHA_BINARY_DIR}
                        --prefix ${PREFIX}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${MHA_BINARY_DIR} --prefix ${PREFIX} "
                      "failed (${rc})")
endif()
foreach(file include/mha/mha.h)
  if(NOT EXISTS ${PREFIX}/${file})
    message(FATAL_ERROR "the install lacks ${PREFIX}/${file}")
  endif()
endforeach()
