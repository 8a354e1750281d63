// The mha library (target mha::mha): multi-head attention modules with
// PyTorch's semantics. Includes every header of the core. Training
// (<mha/train.h>, target mha::train) and the parity checker
// (<mha/parity.h>, target mha::parity) are separate libraries.
#pragma once

#include "mha/attention.h"
#include "mha/flex_attention.h"
#include "mha/gated_delta_net.h"
#include "mha/hf.h"
#include "mha/kv_cache.h"
#include "mha/latent_attention.h"
#include "mha/linear_attention.h"
#include "mha/masks.h"
#include "mha/multi_head_attention.h"
#include "mha/plot.h"
#include "mha/positions.h"
#include "mha/state_dict.h"
#include "mha/transformer.h"
#include "mha/transformer_decoder.h"
#include "mha/version.h"
#include "mha/weights.h"
