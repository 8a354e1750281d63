// Tests of the state-dict file I/O (mha/state_dict.h): Python-made fixtures
// loaded into mha::MultiHeadAttention, C++ round trips in both formats,
// strict and non-strict loading, hostile files, and a round trip through
// Python when a python3 with torch is present.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fixture_helpers.h"
#include "mha/mha.h"
#include "state_dict_files.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

class StateDictTest : public SeededTest {};

/// A fresh directory for the test's files, removed when the test ends.
class StateDictDir {
 public:
  StateDictDir() : path_(fixtures::temp_dir("state-dict")) {}
  ~StateDictDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const {
    return (path_ / name).string();
  }

 private:
  fs::path path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> keys_of(const StateDict& dict) { return dict.keys(); }

/// Expects both dicts to hold the same names (in order), dtypes, shapes and
/// values.
void expect_same(const StateDict& got, const StateDict& expected) {
  ASSERT_EQ(keys_of(got), keys_of(expected));
  for (const auto& item : expected) {
    const torch::Tensor& g = got[item.key()];
    EXPECT_EQ(g.scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(g.sizes(), item.value().sizes()) << item.key();
    EXPECT_TRUE(torch::equal(g, item.value().to(torch::kCPU))) << item.key();
  }
}

/// One tensor of each supported dtype, with awkward shapes and layouts.
StateDict all_dtypes() {
  StateDict d;
  d.insert("f32", torch::randn({4, 3}).t());  // non-contiguous
  d.insert("f64", torch::randn({5}, torch::kFloat64));
  d.insert("f16", torch::randn({2, 3}).to(torch::kFloat16));
  d.insert("bf16", torch::randn({3, 2}).to(torch::kBFloat16));
  d.insert("i64", torch::arange(-3, 4, torch::kInt64));
  d.insert("i32", torch::arange(0, 6, torch::kInt32).reshape({2, 3}));
  d.insert("i16", torch::arange(-2, 2, torch::kInt16));
  d.insert("i8", torch::arange(-4, 4, torch::kInt8));
  d.insert("u8", torch::arange(0, 20, 3, torch::kUInt8));
  d.insert("flag", torch::tensor({true, false, true}));
  d.insert("scalar", torch::tensor(1.5));
  d.insert("empty", torch::zeros({0, 3}));
  d.insert("sliced", torch::arange(40, torch::kFloat32).slice(0, 7, 37, 3));
  d.insert("large", torch::randn({300}));  // numel >= 256
  return d;
}

// --------------------------------------------------------------------------
// Python fixtures into mha::MultiHeadAttention.

mha::MultiHeadAttention make_attention(const nlohmann::json& o) {
  mha::MultiHeadAttention m(
      mha::MultiHeadAttentionOptions(o.at("embed_dim").get<int64_t>(),
                                     o.at("num_heads").get<int64_t>())
          .dropout(o.at("dropout").get<double>())
          .bias(o.at("bias").get<bool>())
          .add_bias_kv(o.at("add_bias_kv").get<bool>())
          .add_zero_attn(o.at("add_zero_attn").get<bool>())
          .kdim(o.at("kdim").get<int64_t>())
          .vdim(o.at("vdim").get<int64_t>())
          .batch_first(o.at("batch_first").get<bool>()));
  m->eval();
  return m;
}

TEST_F(StateDictTest, FixturesExist) {
  EXPECT_EQ(fixtures::index().at("format"), 1);
  EXPECT_EQ(fixtures::of_module("MultiheadAttention").size(), 4u);
  EXPECT_EQ(fixtures::of_module("TransformerEncoderLayer").size(), 5u);
  EXPECT_EQ(fixtures::of_module("TransformerEncoder").size(), 1u);
}

TEST_F(StateDictTest, MultiHeadAttentionKeysEqualPython) {
  for (const auto& fixture : fixtures::of_module("MultiheadAttention")) {
    SCOPED_TRACE(fixture.at("name").get<std::string>());
    auto m = make_attention(fixture.at("options"));
    EXPECT_EQ(keys_of(mha::state_dict(*m)), fixtures::keys(fixture));
    EXPECT_EQ(keys_of(mha::read_state_dict(
                  fixtures::state_dict_files(fixture).front())),
              fixtures::keys(fixture));
  }
}

TEST_F(StateDictTest, MultiHeadAttentionFixturesMatchPython) {
  int checked = 0;
  for (const auto& fixture : fixtures::of_module("MultiheadAttention")) {
    const auto data = fixtures::data(fixture);
    const auto& forward = fixture.at("forward");
    const bool self_attention = forward.at("self_attention");
    const bool need_weights = forward.at("need_weights");
    for (const auto& file : fixtures::state_dict_files(fixture)) {
      SCOPED_TRACE(file);
      auto m = make_attention(fixture.at("options"));
      const mha::LoadResult result = mha::load_state_dict(*m, file);
      EXPECT_TRUE(result.missing_keys.empty());
      EXPECT_TRUE(result.unexpected_keys.empty());

      auto query = data["query"].clone().requires_grad_(true);
      std::vector<torch::Tensor> inputs{query};
      torch::Tensor key, value;
      if (!self_attention) {
        key = data["key"].clone().requires_grad_(true);
        value = data["value"].clone().requires_grad_(true);
        inputs.push_back(key);
        inputs.push_back(value);
      }
      auto [output, weights] = m->forward(
          query, key, value, data["key_padding_mask"], need_weights,
          /*attn_mask=*/{}, forward.at("average_attn_weights").get<bool>());
      expect_close(output, data["output"], 1e-5, 0.0, "output");
      if (need_weights) {
        expect_close(weights, data["weights"], 1e-5, 0.0, "weights");
      }
      const auto grads =
          torch::autograd::grad({(output * data["output_grad"]).sum()}, inputs);
      expect_close(grads[0], data["grad_query"], 1e-5, 0.0, "grad_query");
      if (!self_attention) {
        expect_close(grads[1], data["grad_key"], 1e-5, 0.0, "grad_key");
        expect_close(grads[2], data["grad_value"], 1e-5, 0.0, "grad_value");
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 10);  // 3 fixtures x 3 files + 1 x safetensors
}

TEST_F(StateDictTest, PythonFilesOfAllFormatsHoldTheSameTensors) {
  for (const auto& fixture : fixtures::index().at("fixtures")) {
    const auto files = fixtures::state_dict_files(fixture);
    SCOPED_TRACE(files.front());
    const auto reference = mha::read_state_dict(files.front());
    EXPECT_EQ(keys_of(reference), fixtures::keys(fixture));
    for (size_t i = 1; i < files.size(); ++i) {
      expect_same(mha::read_state_dict(files[i]), reference);
    }
  }
}

// --------------------------------------------------------------------------
// Round trips in C++.

/// A module with parameters, buffers of every dtype, a non-contiguous buffer
/// and a child.
struct ToyImpl : torch::nn::Module {
  explicit ToyImpl(int64_t hidden = 8) {
    weight = register_parameter("weight", torch::randn({3, 4}));
    for (const auto& item : all_dtypes()) {
      register_buffer(item.key(), item.value());
    }
    linear1 = register_module("linear1", torch::nn::Linear(4, hidden));
    linear2 = register_module("linear2", torch::nn::Linear(hidden, 4));
  }
  torch::Tensor weight;
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
};
TORCH_MODULE(Toy);

/// Zeroes (or sets false) every parameter and buffer.
void clear(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& item : mha::state_dict(module)) {
    item.value().zero_();
  }
}

TEST_F(StateDictTest, StateDictOrderIsPyTorchs) {
  Toy toy;
  std::vector<std::string> expected{"weight"};
  for (const auto& key : all_dtypes().keys()) {
    expected.push_back(key);
  }
  for (const char* key :
       {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}) {
    expected.push_back(key);
  }
  EXPECT_EQ(keys_of(mha::state_dict(*toy)), expected);
}

TEST_F(StateDictTest, RoundTripBothFormats) {
  StateDictDir dir;
  for (const char* name : {"toy.safetensors", "toy.pt", "toy.bin"}) {
    SCOPED_TRACE(name);
    Toy saved;
    mha::save_state_dict(*saved, dir.file(name));
    Toy loaded;
    clear(*loaded);
    const auto result = mha::load_state_dict(*loaded, dir.file(name));
    EXPECT_TRUE(result.missing_keys.empty());
    EXPECT_TRUE(result.unexpected_keys.empty());
    expect_same(mha::state_dict(*loaded), mha::state_dict(*saved));
    expect_same(mha::read_state_dict(dir.file(name)), mha::state_dict(*saved));
    EXPECT_FALSE(fs::exists(dir.file(std::string(name) + ".tmp")));
  }
  // The format follows the extension, and the content decides on reading.
  EXPECT_EQ(read_bytes(dir.file("toy.pt")).substr(0, 2), "PK");
  EXPECT_EQ(read_bytes(dir.file("toy.bin")).substr(0, 2), "PK");
  EXPECT_EQ(read_bytes(dir.file("toy.safetensors"))[8], '{');
}

TEST_F(StateDictTest, WriteReadAllDtypesAndLayouts) {
  StateDictDir dir;
  const StateDict tensors = all_dtypes();
  for (const char* name : {"all.safetensors", "all.pt"}) {
    SCOPED_TRACE(name);
    mha::write_state_dict(tensors, dir.file(name));
    const auto back = mha::read_state_dict(dir.file(name));
    expect_same(back, tensors);
    for (const auto& item : back) {
      EXPECT_TRUE(item.value().is_contiguous()) << item.key();
    }
  }
  // An empty state dict is a valid file too.
  for (const char* name : {"none.safetensors", "none.pt"}) {
    mha::write_state_dict(StateDict(), dir.file(name));
    EXPECT_TRUE(mha::read_state_dict(dir.file(name)).is_empty());
  }
}

TEST_F(StateDictTest, SavingReplacesAnExistingFile) {
  StateDictDir dir;
  write_bytes(dir.file("x.safetensors"), "old");
  Toy toy;
  mha::save_state_dict(*toy, dir.file("x.safetensors"));
  expect_same(mha::read_state_dict(dir.file("x.safetensors")),
              mha::state_dict(*toy));
}

TEST_F(StateDictTest, LoadingConvertsDtypesAndKeepsTheModules) {
  StateDictDir dir;
  torch::nn::Linear f64(torch::nn::LinearOptions(4, 3));
  f64->to(torch::kFloat64);
  mha::save_state_dict(*f64, dir.file("f64.safetensors"));
  torch::nn::Linear f32(torch::nn::LinearOptions(4, 3));
  const auto* weight_before = f32->weight.unsafeGetTensorImpl();
  mha::load_state_dict(*f32, dir.file("f64.safetensors"));
  EXPECT_EQ(f32->weight.scalar_type(), torch::kFloat32);
  EXPECT_EQ(f32->weight.unsafeGetTensorImpl(), weight_before);
  EXPECT_TRUE(f32->weight.requires_grad());
  EXPECT_TRUE(torch::equal(f32->weight, f64->weight.to(torch::kFloat32)));
}

TEST_F(StateDictTest, HeaderExamplesRun) {
  // The examples of include/mha/state_dict.h.
  StateDictDir dir;
  mha::MultiHeadAttention attn(8, 2);
  auto sd = mha::state_dict(*attn);  // in_proj_weight, in_proj_bias,
                                     // out_proj.weight, out_proj.bias
  EXPECT_EQ(keys_of(sd),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias",
                                      "out_proj.weight", "out_proj.bias"}));
  mha::save_state_dict(*attn, dir.file("attn.safetensors"));
  mha::MultiHeadAttention other(8, 2);
  mha::load_state_dict(*other, dir.file("attn.safetensors"));
  expect_same(mha::state_dict(*other), sd);
}

// --------------------------------------------------------------------------
// Strict and non-strict loading, and their messages.

/// A module with two linear layers and, optionally, an extra buffer.
struct PairImpl : torch::nn::Module {
  PairImpl(int64_t hidden, bool extra) {
    linear1 = register_module("linear1", torch::nn::Linear(4, hidden));
    linear2 = register_module("linear2", torch::nn::Linear(hidden, 4));
    if (extra) {
      register_buffer("extra", torch::ones({2}));
    }
  }
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
};
TORCH_MODULE(Pair);

TEST_F(StateDictTest, StrictListsEveryMissingAndUnexpectedKey) {
  StateDictDir dir;
  const std::string file = dir.file("pair.pt");
  mha::save_state_dict(*Pair(8, /*extra=*/false), file);

  Pair with_extra(8, /*extra=*/true);
  const auto before = mha::state_dict(*with_extra);
  const std::vector<torch::Tensor> values_before = [&] {
    std::vector<torch::Tensor> v;
    for (const auto& item : before) {
      v.push_back(item.value().clone());
    }
    return v;
  }();
  EXPECT_THROW_MSG(mha::load_state_dict(*with_extra, file),
                   "missing keys (in the module, not in the file): extra");
  EXPECT_THROW_MSG(mha::load_state_dict(*with_extra, file), file);
  // Nothing was loaded.
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].value(), values_before[i]));
  }

  mha::save_state_dict(*Pair(8, /*extra=*/true), dir.file("extra.pt"));
  Pair without(8, /*extra=*/false);
  EXPECT_THROW_MSG(mha::load_state_dict(*without, dir.file("extra.pt")),
                   "unexpected keys (in the file, not in the module): extra");

  // Both at once, every key listed.
  struct OtherImpl : torch::nn::Module {
    OtherImpl() {
      register_buffer("a", torch::zeros({1}));
      register_buffer("b", torch::zeros({1}));
    }
  };
  OtherImpl other;
  try {
    mha::load_state_dict(other, dir.file("extra.pt"));
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("missing keys (in the module, not in the file): "
                           "a, b"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("unexpected keys (in the file, not in the module): "
                           "extra, linear1.weight, linear1.bias, "
                           "linear2.weight, linear2.bias"),
              std::string::npos)
        << message;
  }
}

TEST_F(StateDictTest, NonStrictReturnsMissingAndUnexpectedKeys) {
  StateDictDir dir;
  const std::string file = dir.file("pair.safetensors");
  Pair saved(8, /*extra=*/true);
  mha::save_state_dict(*saved, file);

  struct MixedImpl : torch::nn::Module {
    MixedImpl() {
      linear1 = register_module("linear1", torch::nn::Linear(4, 8));
      register_buffer("own", torch::full({3}, 7.0));
    }
    torch::nn::Linear linear1{nullptr};
  };
  MixedImpl mixed;
  const auto result = mha::load_state_dict(mixed, file, /*strict=*/false);
  EXPECT_EQ(result.missing_keys, std::vector<std::string>{"own"});
  EXPECT_EQ(
      result.unexpected_keys,
      (std::vector<std::string>{"extra", "linear2.weight", "linear2.bias"}));
  EXPECT_TRUE(torch::equal(mixed.linear1->weight, saved->linear1->weight));
  EXPECT_TRUE(
      torch::equal(mixed.named_buffers()["own"], torch::full({3}, 7.0)));
}

TEST_F(StateDictTest, ShapeMismatchesThrowEvenWhenNotStrict) {
  StateDictDir dir;
  const std::string file = dir.file("small.pt");
  mha::save_state_dict(*Pair(8, /*extra=*/false), file);
  Pair big(16, /*extra=*/false);
  for (const bool strict : {true, false}) {
    EXPECT_THROW_MSG(mha::load_state_dict(*big, file, strict),
                     "shape mismatches: linear1.weight: file [8, 4], module "
                     "[16, 4]; linear1.bias: file [8], module [16]; "
                     "linear2.weight: file [4, 8], module [4, 16]");
    EXPECT_THROW_MSG(mha::load_state_dict(*big, file, strict), file);
  }
}

// --------------------------------------------------------------------------
// Save errors.

TEST_F(StateDictTest, SaveErrorsNameTheFileAndTheTensor) {
  StateDictDir dir;
  StateDict complex;
  complex.insert("z", torch::zeros({2}, torch::kComplexFloat));
  EXPECT_THROW_MSG(mha::write_state_dict(complex, dir.file("z.pt")),
                   "tensor 'z' has dtype ComplexFloat; supported: float64");
  StateDict undefined;
  undefined.insert("u", torch::Tensor());
  EXPECT_THROW_MSG(mha::write_state_dict(undefined, dir.file("u.pt")),
                   "tensor 'u' is undefined");
  StateDict reserved;
  reserved.insert("__metadata__", torch::zeros({1}));
  EXPECT_THROW_MSG(mha::write_state_dict(reserved, dir.file("r.safetensors")),
                   "'__metadata__' is reserved");
  EXPECT_FALSE(fs::exists(dir.file("r.safetensors.tmp")));
  const std::string nowhere = dir.file("no/such/dir/x.pt");
  EXPECT_THROW_MSG(mha::save_state_dict(*Pair(2, false), nowhere), nowhere);
}

// --------------------------------------------------------------------------
// Hostile files: every one a c10::Error naming the file, never a crash.

using handmade::floats;
using handmade::one_tensor;
using handmade::Pickle;
using handmade::safetensors;
using handmade::write_zip;

/// Expects reading `path` to throw a c10::Error naming the file and saying
/// `substring`.
void expect_refused(const std::string& path, const std::string& substring) {
  EXPECT_THROW_MSG(mha::read_state_dict(path), substring);
  EXPECT_THROW_MSG(mha::read_state_dict(path), path);
}

TEST_F(StateDictTest, HandMadePicklesLoad) {
  StateDictDir dir;
  // The plain form, with a 2-D strided view at an offset.
  const std::string file = dir.file("ok.pt");
  std::string data(4 * 10, '\0');
  for (int i = 0; i < 10; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(&data[4 * static_cast<size_t>(i)], &v, 4);
  }
  write_zip(file,
            {{"data.pkl", one_tensor("FloatStorage", 10, 1, {2, 3}, {1, 2})},
             {"data/0", data}});
  const auto w = mha::read_state_dict(file)["w"];
  EXPECT_TRUE(torch::equal(
      w, torch::tensor({1.f, 3.f, 5.f, 2.f, 4.f, 6.f}).reshape({2, 3})));

  // Protocol-4 opcodes: FRAME, SHORT_BINUNICODE, STACK_GLOBAL, MEMOIZE,
  // LONG1, BININT, BININT2, TUPLE1/2, a plain dict, _rebuild_parameter.
  Pickle p;
  p.proto(4).op(0x95).raw(std::string(8, '\0'));
  p.op('}').op(0x94);
  p.op(0x8c).op(3).raw("key").op(0x94);
  p.op(0x8c)
      .op(12)
      .raw("torch._utils")
      .op(0x8c)
      .op(18)
      .raw("_rebuild_parameter");
  p.op(0x93);
  p.op(0x8c)
      .op(12)
      .raw("torch._utils")
      .op(0x8c)
      .op(18)
      .raw("_rebuild_tensor_v2");
  p.op(0x93);
  p.mark().mark().str("storage").global("torch", "LongStorage").str("s");
  p.str("cuda:0").op(0x8a).op(2).op(3).op(0).op('t').op('Q');  // numel 3
  p.op('J').raw(std::string("\x01\x00\x00\x00", 4));           // offset 1
  p.op('M').op(2).op(0).op(0x85);                              // size (2,)
  p.int1(1).op(0x85);                                          // stride (1,)
  p.op(0x88).op('}').op('t').op('R');                          // tensor
  p.op(0x88).op('}').op(0x87).op('R');                         // parameter
  p.op('s').op('.');
  std::string longs(3 * 8, '\0');
  longs[8] = 5;
  longs[16] = 7;
  write_zip(dir.file("p4.pt"), {{"data.pkl", p.bytes}, {"data/s", longs}});
  const auto values = mha::read_state_dict(dir.file("p4.pt"));
  ASSERT_EQ(keys_of(values), std::vector<std::string>{"key"});
  EXPECT_TRUE(
      torch::equal(values["key"], torch::tensor({5, 7}, torch::kInt64)));
}

TEST_F(StateDictTest, RefusesForeignGlobalsAndOpcodes) {
  StateDictDir dir;
  // os.system("echo pwned"): refused by name, nothing run.
  Pickle evil;
  evil.proto().global("os", "system").str("echo pwned").op(0x85).op('R');
  evil.op('.');
  write_zip(dir.file("evil.pt"), {{"data.pkl", evil.bytes}});
  expect_refused(dir.file("evil.pt"), "refusing the global 'os.system'");

  // builtins.eval via STACK_GLOBAL.
  Pickle eval;
  eval.proto(4).str("builtins").str("eval").op(0x93).op('.');
  write_zip(dir.file("eval.pt"), {{"data.pkl", eval.bytes}});
  expect_refused(dir.file("eval.pt"), "refusing the global 'builtins.eval'");

  // INST (protocol 0 object creation) is not an accepted opcode.
  Pickle inst;
  inst.proto().mark().raw("ios\nsystem\n").op('.');
  write_zip(dir.file("inst.pt"), {{"data.pkl", inst.bytes}});
  expect_refused(dir.file("inst.pt"), "opcode INST (0x69)");

  // A storage class may not be called.
  Pickle call;
  call.proto().global("torch", "FloatStorage").op(')').op('R').op('.');
  write_zip(dir.file("call.pt"), {{"data.pkl", call.bytes}});
  expect_refused(dir.file("call.pt"), "may appear only in a persistent id");

  // Something other than a dict of tensors.
  Pickle list;
  list.proto().op(']').op('.');
  write_zip(dir.file("list.pt"), {{"data.pkl", list.bytes}});
  expect_refused(dir.file("list.pt"),
                 "must be a dict or collections.OrderedDict of tensors, got "
                 "list");
  Pickle not_tensor;
  not_tensor.proto().op('}').str("w").int1(3).op('s').op('.');
  write_zip(dir.file("int.pt"), {{"data.pkl", not_tensor.bytes}});
  expect_refused(dir.file("int.pt"), "entry 'w' must be a tensor, got int 3");
}

TEST_F(StateDictTest, RefusesTensorsThatDisagreeWithTheirStorage) {
  StateDictDir dir;
  // size (3, 2), stride (2, 1) needs 6 elements, the storage has 4.
  write_zip(dir.file("small.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 4, 0, {3, 2}, {2, 1})},
             {"data/0", floats(4)}});
  expect_refused(dir.file("small.pt"),
                 "a tensor of size [3, 2], stride [2, 1] and storage offset 0 "
                 "reaches past the end of its storage of 4 float32 elements");
  // The offset pushes a fitting view past the end.
  write_zip(dir.file("offset.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 6, 1, {3, 2}, {2, 1})},
             {"data/0", floats(6)}});
  expect_refused(dir.file("offset.pt"), "reaches past the end");
  // The record holds fewer bytes than the pickle declares.
  write_zip(dir.file("record.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 6, 0, {6}, {1})},
             {"data/0", floats(5)}});
  expect_refused(dir.file("record.pt"),
                 "storage record 'data/0' holds 20 bytes, but data.pkl "
                 "declares 6 float32 elements");
  // The record is missing.
  write_zip(dir.file("lacks.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 6, 0, {6}, {1})}});
  expect_refused(dir.file("lacks.pt"), "which the archive lacks");
  // Size and stride of different lengths.
  write_zip(dir.file("dims.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 6, 0, {6}, {1, 1})},
             {"data/0", floats(6)}});
  expect_refused(dir.file("dims.pt"),
                 "the size has 1 dimensions but the "
                 "stride 2");
  // No data.pkl at all.
  write_zip(dir.file("nopkl.pt"), {{"other", "x"}});
  expect_refused(dir.file("nopkl.pt"), "no data.pkl record");
  // Big-endian archives.
  write_zip(dir.file("big.pt"),
            {{"data.pkl", one_tensor("FloatStorage", 6, 0, {6}, {1})},
             {"byteorder", "big"},
             {"data/0", floats(6)}});
  expect_refused(dir.file("big.pt"), "byte order 'big' is not supported");
}

TEST_F(StateDictTest, RefusesTruncatedAndMalformedPickles) {
  StateDictDir dir;
  const std::string good = one_tensor("FloatStorage", 6, 0, {6}, {1});
  write_zip(dir.file("cut.pt"),
            {{"data.pkl", good.substr(0, good.size() - 1)},  // no STOP
             {"data/0", floats(6)}});
  expect_refused(dir.file("cut.pt"), "ends without STOP");
  write_zip(dir.file("cut2.pt"),
            {{"data.pkl", good.substr(0, 40)}, {"data/0", floats(6)}});
  expect_refused(dir.file("cut2.pt"), "data.pkl");
  Pickle underflow;
  underflow.proto().op('s').op('.');
  write_zip(dir.file("underflow.pt"), {{"data.pkl", underflow.bytes}});
  expect_refused(dir.file("underflow.pt"),
                 "the stack (above the last MARK) "
                 "is empty");
  Pickle memo;
  memo.proto().op('h').op(7).op('.');
  write_zip(dir.file("memo.pt"), {{"data.pkl", memo.bytes}});
  expect_refused(dir.file("memo.pt"), "memo entry 7 was never stored");
  Pickle huge_string;
  huge_string.proto().op('X').raw("\xff\xff\xff\x7f").op('.');
  write_zip(dir.file("string.pt"), {{"data.pkl", huge_string.bytes}});
  expect_refused(dir.file("string.pt"), "a string of 2147483647 bytes");
  Pickle wide;
  wide.proto().op(0x8a).op(9).raw(std::string(9, '\1')).op('.');
  write_zip(dir.file("wide.pt"), {{"data.pkl", wide.bytes}});
  expect_refused(dir.file("wide.pt"), "does not fit in 64 bits");
}

TEST_F(StateDictTest, RefusesTruncatedAndForeignFiles) {
  StateDictDir dir;
  Toy toy;
  for (const char* name : {"t.safetensors", "t.pt"}) {
    mha::save_state_dict(*toy, dir.file(name));
    const std::string bytes = read_bytes(dir.file(name));
    for (const size_t keep :
         {bytes.size() - 1, bytes.size() / 2, size_t{100}, size_t{9}}) {
      SCOPED_TRACE(std::string(name) + " cut to " + std::to_string(keep));
      write_bytes(dir.file("cut"), bytes.substr(0, keep));
      expect_refused(dir.file("cut"), "state dict file");
    }
  }
  write_bytes(dir.file("short"), "PK");
  expect_refused(dir.file("short"), "the file has 2 bytes, too short");
  write_bytes(dir.file("empty"), "");
  expect_refused(dir.file("empty"), "the file has 0 bytes");
  write_bytes(dir.file("text"), "hello, this is not a state dict");
  expect_refused(dir.file("text"), "unrecognized format");
  write_bytes(dir.file("legacy"), std::string("\x80\x02\x8a\x0alegacy", 10));
  expect_refused(dir.file("legacy"), "legacy (non-zip) PyTorch file");
  expect_refused(dir.file("does-not-exist"), "no such file");
  EXPECT_THROW_MSG(mha::read_state_dict(dir.file("")), "not a regular file");
}

TEST_F(StateDictTest, RefusesInconsistentSafetensors) {
  StateDictDir dir;
  const std::string f = dir.file("x.safetensors");
  auto refuse = [&](const std::string& header, const std::string& data,
                    const std::string& substring) {
    SCOPED_TRACE(header);
    write_bytes(f, safetensors(header, data));
    expect_refused(f, substring);
  };
  const std::string eight(8, '\0');
  // A valid file, for reference.
  write_bytes(f, safetensors(R"({"a":{"dtype":"F32","shape":[2],)"
                             R"("data_offsets":[0,8]}})",
                             eight));
  EXPECT_EQ(mha::read_state_dict(f)["a"].sizes(), c10::IntArrayRef({2}));

  refuse(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight,
         "data_offsets [0, 8] span 8 bytes, but shape [3] of F32 needs 12");
  refuse(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight,
         "data_offsets [0, 16] out of range: the data section holds 8 bytes");
  refuse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight,
         "occupies bytes [4, 8) of the data section, but the tensors before "
         "it end at byte 0");
  refuse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
         eight, "tensor 'b' occupies bytes [4, 8)");
  refuse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight,
         "the tensors cover 4 bytes, but the data section holds 8");
  refuse(R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", eight,
         "unsupported dtype 'C64'");
  refuse(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight,
         "shape entries must be integers >= 0, got -2");
  refuse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight,
         "data_offsets must be two integers");
  refuse(R"({"a":{"dtype":"F32","shape":[2]}})", eight,
         "needs the fields dtype, shape and data_offsets");
  refuse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})",
         eight, "unknown field 'x'");
  refuse(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],)"
         R"("data_offsets":[0,8]}})",
         eight, "is too large");
  refuse(R"({"__metadata__":{"k":1}})", "",
         "__metadata__ values must be "
         "strings");
  refuse(R"({"a":)", eight, "the header is not valid JSON");
  refuse(R"({"a":1} trailing)", "", "the header is not valid JSON");
  refuse("{" + std::string(100, '[') + std::string(100, ']') + "}", "",
         "the header nests 101 levels deep");
  // Header length past the end of the file, and over the format's limit.
  std::string bytes = safetensors(R"({"a":1})", "");
  bytes[0] = 100;
  write_bytes(f, bytes);
  expect_refused(f, "header length 100 runs past the end of the file");
  bytes[0] = 0;
  bytes[5] = 1;  // 2^40
  write_bytes(f, bytes);
  expect_refused(f, "exceeds the format's limit");
}

TEST_F(StateDictTest, RandomlyDamagedFilesNeverCrash) {
  // Damaged bytes either still form a valid file or raise c10::Error.
  StateDictDir dir;
  StateDict tensors;
  tensors.insert("a", torch::randn({3, 2}));
  tensors.insert("b", torch::arange(5));
  tensors.insert("c", torch::tensor({true, false}));
  mha::write_state_dict(tensors, dir.file("ok.safetensors"));
  const std::string st = read_bytes(dir.file("ok.safetensors"));
  const std::string pickle = one_tensor("FloatStorage", 6, 0, {3, 2}, {2, 1});
  std::mt19937 random(1234);
  int errors = 0;
  int successes = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const bool zip = trial % 2 == 1;
    std::string bytes = zip ? pickle : st;
    const int changes = 1 + static_cast<int>(random() % 4);
    for (int i = 0; i < changes; ++i) {
      const size_t at = random() % bytes.size();
      bytes[at] = static_cast<char>(random() % 256);
    }
    if (random() % 4 == 0) {
      bytes.resize(random() % bytes.size());
    }
    const std::string file = dir.file("damaged");
    if (zip) {
      write_zip(file, {{"data.pkl", bytes}, {"data/0", floats(6)}});
    } else {
      write_bytes(file, bytes);
    }
    try {
      mha::read_state_dict(file);
      ++successes;
    } catch (const c10::Error&) {
      ++errors;
    }
  }
  EXPECT_EQ(errors + successes, 400);
  EXPECT_GT(errors, 100);
}

// --------------------------------------------------------------------------
// C++ -> file -> Python -> file -> C++.

/// The transformation tests/python_roundtrip.py applies.
torch::Tensor transformed(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kBool) {
    return t.logical_not();
  }
  if (t.is_floating_point()) {
    return t * 2;
  }
  return t * 3 - 1;
}

TEST_F(StateDictTest, PythonRoundTrip) {
  std::string tried;
  const std::string python = fixtures::python_with_torch(&tried);
  if (python.empty()) {
    GTEST_SKIP() << "no Python with torch found (tried " << tried
                 << "); install python3-torch (scripts/setup.sh does) or set "
                    "MHA_PYTHON to run the round trip through Python";
  }
  StateDictDir dir;
  Toy toy;
  mha::save_state_dict(*toy, dir.file("cpp.pt"));
  mha::save_state_dict(*toy, dir.file("cpp.safetensors"));

  const std::string log = dir.file("python.log");
  const std::string command = "'" + python + "' '" +
                              MHA_PYTHON_ROUNDTRIP_SCRIPT + "' '" +
                              dir.file("") + "' >'" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  const std::string output = read_bytes(log);
  ASSERT_EQ(status, 0) << command << "\n" << output;
  std::printf("%s", output.c_str());

  StateDict expected;
  for (const auto& item : mha::state_dict(*toy)) {
    expected.insert(item.key(), transformed(item.value()));
  }
  for (const char* name : {"py.pt", "py.dict.pt", "py.safetensors"}) {
    SCOPED_TRACE(name);
    expect_same(mha::read_state_dict(dir.file(name)), expected);
    Toy loaded;
    mha::load_state_dict(*loaded, dir.file(name));
    expect_same(mha::state_dict(*loaded), expected);
  }
}

}  // namespace
