# The C++ standard: C++17 at least, raised to what the found LibTorch needs.
# LibTorch 2.x releases from 2.10 on refuse to compile below C++20.
set(MHA_CXX_STANDARD 17)
if(DEFINED Torch_VERSION AND Torch_VERSION VERSION_GREATER_EQUAL 2.10)
  set(MHA_CXX_STANDARD 20)
endif()
message(STATUS "mha: LibTorch ${Torch_VERSION}, C++${MHA_CXX_STANDARD}")
