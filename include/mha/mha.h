// The mha library: multi-head attention modules with PyTorch's semantics.
// Includes every public header that needs nothing beyond LibTorch.
#pragma once

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/masks.h"
#include "mha/multi_head_attention.h"
#include "mha/parity.h"
#include "mha/plot.h"
#include "mha/positions.h"
#include "mha/state_dict.h"
#include "mha/train.h"
#include "mha/transformer.h"
#include "mha/weights.h"
