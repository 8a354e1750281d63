# The C++ standard: C++17 at least, raised to what the found LibTorch asks
# for. LibTorch's TorchConfig.cmake records its standard in the CXX_STANDARD
# property of the `torch` target (Debian: 14 in 1.13, 17 in 2.6, 20 in 2.14,
# whose headers need C++20); the requirement reaches consumers through
# mha::mha's cxx_std_NN compile feature.
set(MHA_CXX_STANDARD 17)
get_target_property(_mha_torch_cxx_standard torch CXX_STANDARD)
if(_mha_torch_cxx_standard AND _mha_torch_cxx_standard GREATER MHA_CXX_STANDARD)
  set(MHA_CXX_STANDARD ${_mha_torch_cxx_standard})
endif()
unset(_mha_torch_cxx_standard)
message(STATUS "mha: LibTorch ${Torch_VERSION}, C++${MHA_CXX_STANDARD}")
