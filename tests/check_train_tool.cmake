# Checks mha-train end to end on tiny settings: bad arguments give one line
# and exit 2; a run writes its checkpoint, loss.csv and loss.svg and prints
# the accuracy; a run stopped at step k and resumed writes the same losses
# as the uninterrupted run; --task add prints the exact match of greedy
# decoding and examples; --task charlm prints the baseline and a sample
# and draws its attention maps.
# Variables: TOOL (the mha-train executable), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run_tool code)
  execute_process(COMMAND ${TOOL} ${ARGN} WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL code)
    message(FATAL_ERROR "mha-train ${ARGN}: exit ${rc}, expected ${code}\n${out}${err}")
  endif()
  set(last_out "${out}" PARENT_SCOPE)
  set(last_err "${err}" PARENT_SCOPE)
endfunction()

# Bad arguments: exit 2 with exactly one line on stderr that says what.
function(expect_usage_error pattern)
  run_tool(2 ${ARGN})
  string(STRIP "${last_err}" err)
  if(err MATCHES "\n" OR NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "mha-train ${ARGN}: expected one line matching "
                        "'${pattern}' on stderr, got:\n${last_err}")
  endif()
endfunction()

file(WRITE ${WORK_DIR}/short.txt "too short for any context")
expect_usage_error("task" --task nonsense)
expect_usage_error("no such file" --task charlm --text ${WORK_DIR}/missing.txt)
expect_usage_error("--batch-size must be >= 1, got 0" --batch-size 0)
expect_usage_error("too short for a context of 64" --task charlm
                   --text ${WORK_DIR}/short.txt)
expect_usage_error("no checkpoint" --resume --out ${WORK_DIR}/nothing-here)
expect_usage_error("--steps must be >= 1" --steps 0)
expect_usage_error("--no-such-flag" --no-such-flag)
expect_usage_error("apply to --task charlm only" --plot-attention maps)
expect_usage_error("--plot-length must be in \\[1, --context = 64\\], got 65"
                   --task charlm --plot-length 65)
file(WRITE ${WORK_DIR}/a-file "")
expect_usage_error("--plot-attention: cannot write to directory"
                   --task charlm --plot-attention ${WORK_DIR}/a-file/maps)
expect_usage_error("--digits must be in \\[1, 18\\], got 19" --task add --digits 19)
run_tool(0 --help)

# A tiny reverse run, uninterrupted.
set(tiny --max-len 6 --d-model 32 --heads 2 --layers 1 --ff 64 --dropout 0.1
    --batch-size 32 --steps 24 --warmup 4 --eval-every 5 --checkpoint-every 6
    --eval-sequences 100)
run_tool(0 ${tiny} --out whole)
if(NOT last_out MATCHES "held-out accuracy: [0-9.]+% of 100 sequences")
  message(FATAL_ERROR "no accuracy line in:\n${last_out}")
endif()
foreach(file checkpoint/model.safetensors checkpoint/trainer.pt loss.csv loss.svg)
  if(NOT EXISTS ${WORK_DIR}/whole/${file})
    message(FATAL_ERROR "mha-train did not write whole/${file}")
  endif()
endforeach()
# Not a terminal: a bounded number of progress lines.
string(REGEX MATCHALL "\nstep " progress_lines "${last_out}")
list(LENGTH progress_lines progress_count)
if(progress_count LESS 1 OR progress_count GREATER 30)
  message(FATAL_ERROR "expected 1..30 progress lines, got ${progress_count}:\n${last_out}")
endif()
run_tool(0 ${tiny} --out quiet --quiet)
if(last_out MATCHES "\nstep ")
  message(FATAL_ERROR "--quiet printed progress lines:\n${last_out}")
endif()

# The same run stopped after step 9 and resumed: the same losses.
run_tool(0 ${tiny} --out resumed --stop-at 9)
run_tool(0 ${tiny} --out resumed --resume)
if(NOT last_out MATCHES "trained steps 10-24")
  message(FATAL_ERROR "the resumed run did not continue at step 10:\n${last_out}")
endif()
# The columns step, lr, train_loss and val_loss of a loss.csv (not the
# timings), one list entry per row.
function(loss_columns path result)
  file(STRINGS ${path} lines)
  set(columns "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE ",[^,]*,[^,]*$" "" kept "${line}")
    list(APPEND columns "${kept}")
  endforeach()
  set(${result} "${columns}" PARENT_SCOPE)
endfunction()
loss_columns(${WORK_DIR}/whole/loss.csv whole_losses)
loss_columns(${WORK_DIR}/resumed/loss.csv resumed_losses)
list(LENGTH whole_losses rows)
if(NOT rows EQUAL 25 OR NOT whole_losses STREQUAL resumed_losses)
  message(FATAL_ERROR "resumed losses differ from the uninterrupted run's:\n"
                      "${whole_losses}\nvs\n${resumed_losses}")
endif()
# Settings that differ from the checkpoint's are refused.
run_tool(1 ${tiny} --out resumed --resume --lr 0.01)

# A tiny addition model (encoder-decoder).
run_tool(0 --task add --digits 2 --d-model 32 --heads 2 --layers 1 --ff 64
         --batch-size 32 --steps 30 --warmup 3 --eval-sequences 100 --out add
         --quiet)
if(NOT last_out MATCHES "trained steps 1-30 in [0-9]+s \\([0-9.]+ ms/step\\)"
   OR NOT last_out MATCHES "held-out exact match: [0-9.]+% of 100 additions \\([0-9.]+% of answer tokens\\), greedy decoding through the decoder's cache"
   OR NOT last_out MATCHES "examples:\n[0-9]+\\+[0-9]+ = [0-9]+ \\(model: [0-9]*\\)\n")
  message(FATAL_ERROR "mha-train --task add: no time per step, exact match or examples:\n${last_out}")
endif()
if(NOT EXISTS ${WORK_DIR}/add/checkpoint/model.safetensors)
  message(FATAL_ERROR "mha-train --task add did not write add/checkpoint")
endif()

# A tiny character model.
set(text "")
foreach(i RANGE 40)
  string(APPEND text "the cat sat on the mat. the dog sat on the log. ")
endforeach()
file(WRITE ${WORK_DIR}/cats.txt "${text}")
run_tool(0 --task charlm --text ${WORK_DIR}/cats.txt --context 32 --d-model 32
         --heads 2 --layers 1 --batch-size 8 --steps 20 --warmup 2
         --sample-len 30 --prompt "the " --out charlm --quiet
         --plot-attention maps --plot-length 12)
if(NOT last_out MATCHES "unigram baseline [0-9.]+ nats/char"
   OR NOT last_out MATCHES "validation loss [0-9.]+ nats/char"
   OR NOT last_out MATCHES "sample \\(temperature 0.8, top-k 10; 30 characters in [0-9.]+ s, KV cache\\):\nthe "
   OR NOT last_out MATCHES "attention maps \\(1 layers x 2 heads, 12 validation characters\\): maps/layer0.svg")
  message(FATAL_ERROR "charlm output lacks the baseline, loss, sample or maps:\n${last_out}")
endif()
# The same run sampling without the KV caches writes the same sample.
string(REGEX MATCH "KV cache\\):\n[^\n]*" cached_sample "${last_out}")
run_tool(0 --task charlm --text ${WORK_DIR}/cats.txt --context 32 --d-model 32
         --heads 2 --layers 1 --batch-size 8 --steps 20 --warmup 2
         --sample-len 30 --prompt "the " --out charlm-recomputed --quiet
         --no-kv-cache)
string(REGEX MATCH "recomputed every step\\):\n[^\n]*" recomputed_sample
       "${last_out}")
string(REPLACE "KV cache):" "" cached_sample "${cached_sample}")
string(REPLACE "recomputed every step):" "" recomputed_sample
       "${recomputed_sample}")
if(cached_sample STREQUAL "" OR NOT cached_sample STREQUAL recomputed_sample)
  message(FATAL_ERROR "--no-kv-cache sampled '${recomputed_sample}', the KV "
                      "cache '${cached_sample}'")
endif()
# Packed documents: the header says how, the report compares the
# characters/s of packing and padding the same documents; a checkpoint of
# windows does not resume packed.
run_tool(0 --task charlm --text ${WORK_DIR}/cats.txt --context 32 --d-model 32
         --heads 2 --layers 1 --batch-size 8 --steps 6 --warmup 2
         --sample-len 10 --out packed --quiet --packed --compare-batches 2)
if(NOT last_out MATCHES "documents: lengths 4-32 \\(a row's last one cut to fit\\), packed into rows of 32 characters"
   OR NOT last_out MATCHES "packed vs padded: [0-9]+ vs [0-9]+ document characters/s, [0-9.]+x \\(forward \\+ backward of the same 2 batches, 512 characters in [0-9]+ documents; padding [0-9.]+% of the padded positions\\)")
  message(FATAL_ERROR "mha-train --packed: no documents line or comparison:\n${last_out}")
endif()
run_tool(1 --task charlm --text ${WORK_DIR}/cats.txt --context 32 --d-model 32
         --heads 2 --layers 1 --batch-size 8 --steps 20 --warmup 2
         --sample-len 30 --out charlm --quiet --resume --packed)
expect_usage_error("--packed and --padded exclude each other" --task charlm
                   --packed --padded)
expect_usage_error("--packed, --padded, --doc-min-len and --doc-max-len apply to --task charlm only"
                   --packed)
expect_usage_error("1 <= --doc-min-len <= --doc-max-len <= --context = 64, got 8 and 65"
                   --task charlm --packed --doc-max-len 65)
expect_usage_error("--doc-min-len and --doc-max-len need --packed or --padded"
                   --task charlm --doc-min-len 3)
run_tool(2 --task charlm --text ${WORK_DIR}/cats.txt --positions absolute)

# --attention: the linear-cost kinds on the tiny runs, and their refusals.
expect_usage_error("--attention linformer cannot be causal" --task charlm
                   --text ${WORK_DIR}/cats.txt --attention linformer)
expect_usage_error("--attention applies to --task reverse, sort and charlm"
                   --task add --attention linear)
expect_usage_error("--projected-length needs --attention linformer"
                   --projected-length 3)
expect_usage_error("--attention performer never forms the attention maps"
                   --task charlm --text ${WORK_DIR}/cats.txt
                   --attention performer --plot-attention maps)
expect_usage_error("--packed needs --attention softmax" --task charlm
                   --text ${WORK_DIR}/cats.txt --packed --attention linear)
run_tool(0 ${tiny} --out linformer --attention linformer --projected-length 3)
if(NOT last_out MATCHES "attention: linformer" OR
   NOT last_out MATCHES "held-out accuracy: [0-9.]+% of 100 sequences")
  message(FATAL_ERROR "--attention linformer: no attention or accuracy "
                      "line in:\n${last_out}")
endif()
run_tool(0 --task charlm --text ${WORK_DIR}/cats.txt --context 32 --d-model 32
         --heads 2 --layers 1 --batch-size 8 --steps 20 --warmup 2
         --sample-len 30 --prompt "the " --out charlm-performer
         --attention performer)
if(NOT last_out MATCHES "attention: performer" OR
   NOT last_out MATCHES "validation loss [0-9.]+ nats/char" OR
   NOT last_out MATCHES "30 characters in [0-9.]+ s, KV cache\\):\nthe ")
  message(FATAL_ERROR "--attention performer: no attention, loss or sample "
                      "line in:\n${last_out}")
endif()
file(READ ${WORK_DIR}/maps/layer0.svg svg)
string(REGEX MATCHALL "class=\"cell masked\"" masked "${svg}")
list(LENGTH masked masked_count)
if(NOT svg MATCHES "layer 0, head 1" OR NOT masked_count EQUAL 132)
  message(FATAL_ERROR "maps/layer0.svg: expected 2 head panels with 66 masked "
                      "cells each, got ${masked_count} masked cells")
endif()
# Data-parallel training: bad job variables and options give one line and
# exit 2; --nproc 2 trains with one report, from rank 0. (The equivalence
# with one process is checked number by number in test_distributed.cpp.)
set(ENV{WORLD_SIZE} 2)
set(ENV{RANK} 2)
expect_usage_error("RANK must be in \\[0, WORLD_SIZE - 1 = 1\\], but got 2"
                   --steps 1)
set(ENV{RANK} x)
expect_usage_error("RANK must be an integer, but got 'x'" --steps 1)
set(ENV{RANK} 0)
expect_usage_error("--nproc starts its own workers" --nproc 2)
unset(ENV{RANK})
expect_usage_error("RANK and WORLD_SIZE must be set together" --steps 1)
unset(ENV{WORLD_SIZE})
expect_usage_error("--nproc must be >= 1, got 0" --nproc 0)
expect_usage_error("--batch-size \\(1\\) must be >= the number of processes \\(2\\)"
                   --nproc 2 --batch-size 1)
expect_usage_error("--timeout must be > 0" --nproc 2 --timeout 0)
set(ENV{MASTER_PORT} 99999)
expect_usage_error("MASTER_PORT must be in \\[1, 65535\\], but got '99999'" --nproc 2)
unset(ENV{MASTER_PORT})
run_tool(0 ${tiny} --out parallel --nproc 2)
string(REGEX MATCHALL "held-out accuracy" reports "${last_out}")
list(LENGTH reports report_count)
if(NOT last_out MATCHES "data-parallel: 2 processes \\(gloo at 127.0.0.1:[0-9]+\\), 16 sequences each"
   OR NOT report_count EQUAL 1)
  message(FATAL_ERROR "mha-train --nproc 2: expected one report from rank 0:\n${last_out}${last_err}")
endif()
loss_columns(${WORK_DIR}/parallel/loss.csv parallel_losses)
list(LENGTH parallel_losses rows)
if(NOT rows EQUAL 25)
  message(FATAL_ERROR "mha-train --nproc 2: loss.csv has ${rows} rows, expected 25")
endif()
message(STATUS "mha-train: exit codes, files, exact resume, charlm and --nproc ok")
