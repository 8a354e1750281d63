# The C++ standard: C++17 at least, raised to what the found LibTorch needs.
# LibTorch 2.14 (Debian unstable) refuses C++17; 2.6 accepts it. The 2.10
# threshold below is an assumption, not yet checked against every release
# in between (see the version-matrix issue).
set(MHA_CXX_STANDARD 17)
if(DEFINED Torch_VERSION AND Torch_VERSION VERSION_GREATER_EQUAL 2.10)
  set(MHA_CXX_STANDARD 20)
endif()
message(STATUS "mha: LibTorch ${Torch_VERSION}, C++${MHA_CXX_STANDARD}")
