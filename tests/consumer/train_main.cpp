// Links mha::train from the install tree and checks one result: the ids of
// a character vocabulary (sorted distinct bytes of " dehlorw").
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
