# Checks mha-bench's documented exit codes (0 ok, 1 results differ, 2 bad
# usage) and the --json report of a --quick run: the environment keys, one
# row per configuration and mode, passed checks, the dense FLOP count, the
# direction of the ratio, and peak memory by both methods; the third
# contender, projections + at::scaled_dot_product_attention: "n/a (LibTorch
# < 2.0)" below 2.0, else timed and checked in every mode but fwd-weights;
# the batched decoding table (one left-padded cache equal to each sequence
# alone; FAIL with --plant-fault) in the text and the JSON; the projections
# table's rows.
# Variables: TOOL (the mha-bench executable), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/expect_exit.cmake)

expect_exit(2 --no-such-flag)
expect_exit(2 --config 1,2,3)
expect_exit(2 --config 2,16,30,4)  # E not divisible by H
expect_exit(2 --mode no-such-mode)
expect_exit(2 --warmup 0)
expect_exit(0 --help)
execute_process(COMMAND ${TOOL} --quick --device cuda RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 AND NOT rc EQUAL 0)
  message(FATAL_ERROR "--device cuda: exit ${rc}; expected 2 without CUDA, 0 with")
endif()
if(rc EQUAL 2 AND NOT err MATCHES "CUDA is not available")
  message(FATAL_ERROR "--device cuda without CUDA must say so, got: ${err}")
endif()
# A wrong result is reported and not timed.
expect_exit(1 --quick --plant-fault --config 1,8,8,2 --mode fwd,encoder
            --gemm-size 32)
if(NOT last_output MATCHES "FAIL")
  message(FATAL_ERROR "--plant-fault: expected FAIL rows, got:\n${last_output}")
endif()
# The fault is planted in the SDPA contender too: its check fails where it
# runs; below LibTorch 2.0 the table says why it does not.
if(NOT last_output MATCHES "LibTorch:  1\\." AND
   NOT last_output MATCHES "sdpa FAIL output")
  message(FATAL_ERROR "--plant-fault: expected sdpa FAIL, got:\n${last_output}")
endif()
# Batched decoding with the fault (no key_padding_mask: the pads are
# attended) differs from the sequences decoded alone: its row says FAIL.
if(NOT last_output MATCHES "\n +3 +[0-9]+ [^\n]*x  FAIL [0-9.e+-]+\n")
  message(FATAL_ERROR "--plant-fault: expected a FAIL row in the batched "
          "decoding table, got:\n${last_output}")
endif()
if(last_output MATCHES "LibTorch:  1\\." AND
   NOT last_output MATCHES "n/a \\(LibTorch < 2\\.0\\)")
  message(FATAL_ERROR "LibTorch 1.x: expected \"n/a (LibTorch < 2.0)\" in "
          "the SDPA column, got:\n${last_output}")
endif()

# The quick run and its JSON.
set(modes fwd fwd-weights causal fwd-bwd inference encoder)
set(configs "2,16,32,4" "1,32,16,2")  # --quick's
expect_exit(0 --quick --json ${WORK_DIR}/bench.json)
set(quick_output "${last_output}")
file(READ ${WORK_DIR}/bench.json json)
foreach(key cpu_model blas libtorch intra_op_threads omp_wait_policy
            openblas_num_threads_env blocked_gemm blocked_items)
  string(JSON value GET "${json}" environment ${key})
  if(value STREQUAL "")
    message(FATAL_ERROR "environment.${key} is empty")
  endif()
endforeach()
string(JSON spin_type TYPE "${json}" environment openblas_workers_spin)
if(NOT spin_type STREQUAL "BOOLEAN")
  message(FATAL_ERROR "environment.openblas_workers_spin is ${spin_type}, "
          "expected a boolean")
endif()
string(JSON threads GET "${json}" environment intra_op_threads)
string(JSON wait_policy GET "${json}" environment omp_wait_policy)
string(JSON gemm GET "${json}" environment gemm gflops)
string(JSON libtorch GET "${json}" environment libtorch)
string(JSON sdpa_available GET "${json}" environment sdpa_available)
if(libtorch VERSION_LESS 2.0 AND sdpa_available OR
   libtorch VERSION_GREATER_EQUAL 2.0 AND NOT sdpa_available)
  message(FATAL_ERROR "LibTorch ${libtorch}: sdpa_available ${sdpa_available}")
endif()
if(NOT threads EQUAL 2)
  message(FATAL_ERROR "intra_op_threads ${threads}, expected 2 (the default)")
endif()
if(NOT DEFINED ENV{OMP_WAIT_POLICY} AND NOT wait_policy STREQUAL "PASSIVE")
  message(FATAL_ERROR "OMP_WAIT_POLICY ${wait_policy}, expected PASSIVE")
endif()
if(NOT gemm GREATER 0)
  message(FATAL_ERROR "GEMM ceiling ${gemm} GFLOP/s")
endif()
# oneDNN's dnnl_sgemm is timed where the blocked path's products use it (a
# float32 CPU run), and the ceiling is the higher of the two products.
string(JSON blocked_gemm GET "${json}" environment blocked_gemm)
string(JSON onednn_gemm GET "${json}" environment gemm onednn_gflops)
string(JSON ceiling GET "${json}" environment gemm ceiling_gflops)
if(blocked_gemm MATCHES "^oneDNN" AND NOT onednn_gemm GREATER 0 OR
   NOT blocked_gemm MATCHES "^oneDNN" AND NOT onednn_gemm EQUAL 0)
  message(FATAL_ERROR "blocked_gemm ${blocked_gemm}: oneDNN's GEMM "
          "${onednn_gemm} GFLOP/s")
endif()
if(onednn_gemm GREATER gemm AND NOT ceiling EQUAL onednn_gemm OR
   NOT onednn_gemm GREATER gemm AND NOT ceiling EQUAL gemm)
  message(FATAL_ERROR "ceiling ${ceiling} GFLOP/s, not the higher of "
          "torch::mm's ${gemm} and oneDNN's ${onednn_gemm}")
endif()

list(LENGTH configs config_count)
list(LENGTH modes mode_count)
math(EXPR expected_rows "${config_count} * ${mode_count}")
string(JSON row_count LENGTH "${json}" rows)
if(NOT row_count EQUAL expected_rows)
  message(FATAL_ERROR "${row_count} rows, expected ${expected_rows}")
endif()
set(i 0)
foreach(config IN LISTS configs)
  string(REPLACE "," ";" nleh "${config}")
  list(GET nleh 0 N)
  list(GET nleh 1 L)
  list(GET nleh 2 E)
  # Dense FLOPs: 8*N*L*E^2 + 4*N*L*S*E (S = L); encoder + 4*N*L*E*F, F = 4E;
  # x3 with the backward pass.
  math(EXPR forward "8 * ${N} * ${L} * ${E} * ${E} + 4 * ${N} * ${L} * ${L} * ${E}")
  foreach(mode IN LISTS modes)
    set(flops ${forward})
    if(mode STREQUAL "fwd-bwd")
      math(EXPR flops "3 * ${forward}")
    elseif(mode STREQUAL "encoder")
      math(EXPR flops "${forward} + 4 * ${N} * ${L} * ${E} * 4 * ${E}")
    endif()
    string(JSON got_mode GET "${json}" rows ${i} mode)
    string(JSON got_flops GET "${json}" rows ${i} flops)
    string(JSON got_l GET "${json}" rows ${i} config L)
    string(JSON passed GET "${json}" rows ${i} check passed)
    string(JSON reps GET "${json}" rows ${i} reps)
    set(where "row ${i} (${config} ${mode})")
    if(NOT got_mode STREQUAL mode OR NOT got_l EQUAL L)
      message(FATAL_ERROR "${where}: got mode ${got_mode}, L ${got_l}")
    endif()
    if(NOT got_flops EQUAL flops)
      message(FATAL_ERROR "${where}: flops ${got_flops}, expected ${flops}")
    endif()
    if(NOT passed OR NOT reps EQUAL 3)
      message(FATAL_ERROR "${where}: check passed ${passed}, reps ${reps}")
    endif()
    foreach(who mha torch_nn)
      string(JSON status GET "${json}" rows ${i} ${who} status)
      string(JSON median_${who} GET "${json}" rows ${i} ${who} median_ms)
      string(JSON samples LENGTH "${json}" rows ${i} ${who} samples_ms)
      string(JSON peak GET "${json}" rows ${i} ${who} peak_mib)
      if(NOT status STREQUAL "ok" OR NOT median_${who} GREATER 0
         OR NOT samples EQUAL 3 OR peak STREQUAL "" OR peak STREQUAL "null")
        message(FATAL_ERROR "${where}: ${who} status ${status}, median "
                "${median_${who}}, ${samples} samples, peak ${peak}")
      endif()
    endforeach()
    # The attention path mha took: one of the three; with weights on CPU in
    # float32 always the blocked one (src/core/attention_core.cpp's choose_path).
    string(JSON path GET "${json}" rows ${i} mha path)
    if(NOT path MATCHES "^(fused|blocked|explicit)$" OR
       mode STREQUAL "fwd-weights" AND NOT path STREQUAL "blocked")
      message(FATAL_ERROR "${where}: mha path ${path}")
    endif()
    # ratio = mha / torch::nn: above 1 exactly when mha is slower.
    string(JSON ratio GET "${json}" rows ${i} ratio)
    if(median_mha GREATER median_torch_nn AND NOT ratio GREATER 1 OR
       median_mha LESS median_torch_nn AND NOT ratio LESS 1)
      message(FATAL_ERROR "${where}: ratio ${ratio} for mha ${median_mha} ms, "
              "torch::nn ${median_torch_nn} ms")
    endif()
    # The projections+SDPA contender: n/a below LibTorch 2.0 and in
    # fwd-weights rows (no weights from SDPA), else checked against
    # torch::nn, timed, and mha/sdpa in the direction of the medians.
    string(JSON sdpa_status GET "${json}" rows ${i} sdpa status)
    string(JSON sdpa_ratio GET "${json}" rows ${i} sdpa_ratio)
    string(JSON sdpa_ratio_type TYPE "${json}" rows ${i} sdpa_ratio)
    if(NOT sdpa_available OR mode STREQUAL "fwd-weights")
      string(JSON reason GET "${json}" rows ${i} sdpa reason)
      if(NOT sdpa_status STREQUAL "n/a" OR NOT sdpa_ratio_type STREQUAL "NULL" OR
         NOT sdpa_available AND NOT reason STREQUAL "LibTorch < 2.0" OR
         sdpa_available AND NOT reason MATCHES "weights")
        message(FATAL_ERROR "${where}: sdpa ${sdpa_status} (${reason}), "
                "ratio ${sdpa_ratio}")
      endif()
    else()
      string(JSON sdpa_passed GET "${json}" rows ${i} sdpa check passed)
      string(JSON sdpa_compared LENGTH "${json}" rows ${i} sdpa check compared)
      string(JSON median_sdpa GET "${json}" rows ${i} sdpa median_ms)
      string(JSON samples LENGTH "${json}" rows ${i} sdpa samples_ms)
      # fwd-bwd compares output, grad input and the four parameter grads.
      set(want_compared 1)
      if(mode STREQUAL "fwd-bwd")
        set(want_compared 6)
      endif()
      if(NOT sdpa_status STREQUAL "ok" OR NOT sdpa_passed OR
         NOT sdpa_compared EQUAL want_compared OR NOT samples EQUAL 3 OR
         NOT median_sdpa GREATER 0)
        message(FATAL_ERROR "${where}: sdpa ${sdpa_status}, check passed "
                "${sdpa_passed} over ${sdpa_compared} tensors, ${samples} "
                "samples, median ${median_sdpa}")
      endif()
      if(median_mha GREATER median_sdpa AND NOT sdpa_ratio GREATER 1 OR
         median_mha LESS median_sdpa AND NOT sdpa_ratio LESS 1)
        message(FATAL_ERROR "${where}: sdpa_ratio ${sdpa_ratio} for mha "
                "${median_mha} ms, sdpa ${median_sdpa} ms")
      endif()
    endif()
    math(EXPR i "${i} + 1")
  endforeach()
endforeach()
string(JSON differ GET "${json}" summary results_differ)
string(JSON exit_code GET "${json}" summary exit_code)
if(NOT differ EQUAL 0 OR NOT exit_code EQUAL 0)
  message(FATAL_ERROR "summary: results_differ ${differ}, exit_code ${exit_code}")
endif()

# The variants' tables: --quick's two window lengths, and generation through
# the KV cache giving the recomputed characters.
string(JSON window_rows LENGTH "${json}" window)
string(JSON window_ms GET "${json}" window 1 windowed_ms)
string(JSON identical GET "${json}" generation identical)
string(JSON cached_s GET "${json}" generation cached_s)
if(NOT window_rows EQUAL 2 OR NOT window_ms GREATER 0 OR NOT identical
   OR NOT cached_s GREATER 0)
  message(FATAL_ERROR "variants: ${window_rows} window rows (${window_ms} ms), "
          "generation identical ${identical}, ${cached_s} s")
endif()
# Batched decoding (--quick: B = 3 prompts of 8..16 tokens, the first 16
# and the last 8, 8 new tokens each): one left-padded cache gave what each
# sequence gave alone, within the stated tolerance, and both ways were timed.
string(JSON bd_passed GET "${json}" batched_decode passed)
string(JSON bd_tolerance GET "${json}" batched_decode tolerance)
string(JSON bd_rows LENGTH "${json}" batched_decode rows)
string(JSON bd_batch GET "${json}" batched_decode rows 0 batch)
string(JSON bd_count LENGTH "${json}" batched_decode rows 0 prompt_lengths)
string(JSON bd_first GET "${json}" batched_decode rows 0 prompt_lengths 0)
string(JSON bd_last GET "${json}" batched_decode rows 0 prompt_lengths 2)
string(JSON bd_row_passed GET "${json}" batched_decode rows 0 passed)
string(JSON bd_diff GET "${json}" batched_decode rows 0 max_abs_diff)
string(JSON bd_batched GET "${json}" batched_decode rows 0 batched
       decode_tokens_per_s)
string(JSON bd_single GET "${json}" batched_decode rows 0 one_at_a_time
       decode_tokens_per_s)
string(JSON bd_speedup GET "${json}" batched_decode rows 0 decode_speedup)
if(NOT bd_passed OR NOT bd_row_passed OR NOT bd_rows EQUAL 1 OR
   NOT bd_batch EQUAL 3 OR NOT bd_count EQUAL 3 OR NOT bd_first EQUAL 16 OR
   NOT bd_last EQUAL 8 OR
   NOT bd_tolerance EQUAL 1e-05 OR NOT bd_diff LESS_EQUAL bd_tolerance OR
   NOT bd_batched GREATER 0 OR NOT bd_single GREATER 0 OR
   bd_batched GREATER bd_single AND NOT bd_speedup GREATER 1 OR
   bd_batched LESS bd_single AND NOT bd_speedup LESS 1)
  message(FATAL_ERROR "batched_decode: passed ${bd_passed}/${bd_row_passed}, "
          "${bd_rows} rows, B ${bd_batch}, ${bd_count} lengths (${bd_first} "
          "... ${bd_last}), max |diff| "
          "${bd_diff} (tolerance ${bd_tolerance}), tokens/s batched "
          "${bd_batched}, one at a time ${bd_single}, speedup ${bd_speedup}")
endif()
if(NOT quick_output MATCHES "\nbatched decoding: " OR
   NOT quick_output MATCHES "\n +3 +[0-9]+ [^\n]*x  ok [0-9.e+-]+\n")
  message(FATAL_ERROR "the batched decoding table is missing or failed:\n"
          "${quick_output}")
endif()
expect_exit(2 --variants no-such-table)
# Only the batched decoding table.
expect_exit(0 --quick --config 1,8,8,2 --mode inference --gemm-size 32
            --variants batched-decode --json ${WORK_DIR}/decode.json)
file(READ ${WORK_DIR}/decode.json decode_json)
string(JSON generation_type TYPE "${decode_json}" generation)
string(JSON window_type TYPE "${decode_json}" window)
string(JSON bd_passed GET "${decode_json}" batched_decode passed)
if(NOT generation_type STREQUAL "NULL" OR NOT window_type STREQUAL "NULL" OR
   NOT bd_passed)
  message(FATAL_ERROR "--variants batched-decode: generation ${generation_type}, "
          "window ${window_type}, batched_decode passed ${bd_passed}")
endif()

# Only the FlexAttention table (--quick: L = 256): nine cases (five eager,
# four fused), each with its density in (0, 1], positive times, and a
# built-in time where one exists.
expect_exit(0 --quick --config 1,8,8,2 --mode inference --gemm-size 32
            --variants flex --json ${WORK_DIR}/flex.json)
file(READ ${WORK_DIR}/flex.json flex_json)
string(JSON window_type TYPE "${flex_json}" window)
string(JSON flex_rows LENGTH "${flex_json}" flex)
if(NOT window_type STREQUAL "NULL" OR NOT flex_rows EQUAL 9)
  message(FATAL_ERROR "--variants flex: window ${window_type}, ${flex_rows} "
          "flex rows (expected 9)")
endif()
foreach(i RANGE 8)
  string(JSON f_case GET "${flex_json}" flex ${i} case)
  string(JSON f_density GET "${flex_json}" flex ${i} density)
  string(JSON f_fwd GET "${flex_json}" flex ${i} flex_fwd_ms)
  string(JSON f_fb GET "${flex_json}" flex ${i} flex_fwd_bwd_ms)
  string(JSON f_diff GET "${flex_json}" flex ${i} max_abs_diff)
  if(f_density LESS_EQUAL 0 OR f_density GREATER 1 OR f_fwd LESS_EQUAL 0 OR
     f_fb LESS_EQUAL 0 OR f_diff GREATER 1e-4)
    message(FATAL_ERROR "--variants flex row ${i} (${f_case}): density "
            "${f_density}, forward ${f_fwd} ms, forward+backward ${f_fb} ms, "
            "max |flex - built-in| ${f_diff}")
  endif()
endforeach()
# Only the linear-cost attention table (--quick: L = 64, 128): a row per
# kind and length, and the decoding rows.
expect_exit(0 --quick --config 1,8,8,2 --mode inference --gemm-size 32
            --variants linear --json ${WORK_DIR}/linear.json)
file(READ ${WORK_DIR}/linear.json linear_json)
string(JSON window_type TYPE "${linear_json}" window)
string(JSON linear_rows LENGTH "${linear_json}" linear rows)
string(JSON decode_rows LENGTH "${linear_json}" linear decoding)
string(JSON first_kind GET "${linear_json}" linear rows 0 kind)
string(JSON last_kind GET "${linear_json}" linear rows 7 kind)
string(JSON performer_ms GET "${linear_json}" linear decoding 1 performer_ms)
if(NOT window_type STREQUAL "NULL" OR NOT linear_rows EQUAL 8 OR
   NOT decode_rows EQUAL 2 OR NOT first_kind STREQUAL "softmax" OR
   NOT last_kind STREQUAL "linformer" OR NOT performer_ms GREATER 0)
  message(FATAL_ERROR "--variants linear: window ${window_type}, "
          "${linear_rows} rows (expected 8, softmax first, linformer last: "
          "${first_kind}, ${last_kind}), ${decode_rows} decoding rows "
          "(expected 2; performer ${performer_ms} ms)")
endif()

# Only the projections table: a row per configuration with L <= 256 and
# self-attention mode (not encoder), each with its three medians.
expect_exit(0 --quick --config 1,32,16,2 --config 1,300,8,2
            --mode fwd-bwd,inference,encoder --gemm-size 32
            --variants projections --json ${WORK_DIR}/projections.json)
file(READ ${WORK_DIR}/projections.json projections_json)
string(JSON window_type TYPE "${projections_json}" window)
string(JSON projection_rows LENGTH "${projections_json}" projections)
if(NOT window_type STREQUAL "NULL" OR NOT projection_rows EQUAL 2)
  message(FATAL_ERROR "--variants projections: window ${window_type}, "
          "${projection_rows} projection rows (expected 2: (1,32,16,2) "
          "fwd-bwd and inference)")
endif()
foreach(i 0 1)
  string(JSON p_config GET "${projections_json}" projections ${i} config)
  string(JSON p_mode GET "${projections_json}" projections ${i} mode)
  string(JSON p_reps GET "${projections_json}" projections ${i} reps)
  string(JSON p_projections GET "${projections_json}" projections ${i}
         projections_ms)
  string(JSON p_ours GET "${projections_json}" projections ${i}
         mha_projections_ms)
  string(JSON p_nn GET "${projections_json}" projections ${i} torch_nn_ms)
  string(JSON p_mha GET "${projections_json}" projections ${i} mha_ms)
  if(i EQUAL 0)
    set(expected_mode fwd-bwd)
  else()
    set(expected_mode inference)
  endif()
  if(NOT p_config STREQUAL "(1,32,16,2)" OR NOT p_mode STREQUAL expected_mode
     OR NOT p_reps EQUAL 3 OR NOT p_projections GREATER 0 OR
     NOT p_ours GREATER 0 OR NOT p_nn GREATER 0 OR NOT p_mha GREATER 0)
    message(FATAL_ERROR "projections row ${i}: ${p_config} ${p_mode}, reps "
            "${p_reps}, projections ${p_projections} ms (mha's "
            "${p_ours}), torch::nn ${p_nn} ms, mha ${p_mha} ms")
  endif()
endforeach()
if(NOT last_output MATCHES "\nprojections: " OR
   NOT last_output MATCHES "\n\\(1,32,16,2\\) +fwd-bwd +3 ")
  message(FATAL_ERROR "the projections table is missing:\n${last_output}")
endif()

# Peak memory from a child process per measurement (the fallback).
expect_exit(0 --quick --memory fork --config 1,32,16,2 --mode inference
            --gemm-size 32 --json ${WORK_DIR}/fork.json)
file(READ ${WORK_DIR}/fork.json json)
string(JSON method GET "${json}" settings memory_method)
string(JSON peak GET "${json}" rows 0 torch_nn peak_mib)
string(JSON sdpa_peak GET "${json}" rows 0 sdpa peak_mib)
string(JSON sdpa_peak_type TYPE "${json}" rows 0 sdpa peak_mib)
if(NOT method STREQUAL "fork" OR NOT peak GREATER_EQUAL 0 OR
   sdpa_available AND NOT sdpa_peak GREATER_EQUAL 0 OR
   NOT sdpa_available AND NOT sdpa_peak_type STREQUAL "NULL")
  message(FATAL_ERROR "--memory fork: method ${method}, peak ${peak}, sdpa "
          "peak ${sdpa_peak}")
endif()
message(STATUS "mha-bench: exit codes ok, ${row_count} rows in JSON, "
        "GEMM ${gemm} GFLOP/s, LibTorch ${libtorch} (SDPA contender: "
        "${sdpa_available})")
