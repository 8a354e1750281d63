// Links mha::train from the install tree and checks one result: the ids of
// a character vocabulary, the sorted distinct bytes of "hello world"
// (' ' d e h l o r w: h = 3, e = 2, l = 4, o = 5).
#include <mha/train.h>

#include <iostream>

int main() {
  const mha::train::CharVocab vocab("hello world");
  const auto ids = vocab.encode("hello");
  const bool ok =
      torch::equal(ids, torch::tensor({3, 2, 4, 4, 5}, torch::kLong)) &&
      vocab.decode(ids) == "hello";
  std::cout << (ok ? "consumer_train: ok" : "consumer_train: wrong result")
            << '\n';
  return ok ? 0 : 1;
}
