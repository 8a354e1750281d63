# Checks that mha-train survives SIGKILL (issue 22, item 6): a run is
# killed at several moments (CMake's execute_process TIMEOUT kills the
# process with SIGKILL), each time resumed from its last complete checkpoint
# (or started afresh when it had written none yet), and finally resumed to
# the end; its loss.csv must then equal the uninterrupted run's (columns
# step, lr, train_loss, val_loss, not the timings).
# Variables: TOOL (the mha-train executable), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

set(tiny --max-len 6 --d-model 32 --heads 2 --layers 1 --ff 64 --dropout 0.1
    --batch-size 32 --steps 120 --warmup 4 --eval-every 10
    --checkpoint-every 3 --eval-sequences 50 --quiet)

string(TIMESTAMP start "%s%f" UTC)
execute_process(COMMAND ${TOOL} ${tiny} --out ${WORK_DIR}/whole RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(TIMESTAMP end "%s%f" UTC)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the uninterrupted run failed (${rc}):\n${out}${err}")
endif()
# Its wall time in centiseconds: the kills below are timed from it, so that
# a loaded machine (slower start-up and steps) moves them along.
math(EXPR whole_cs "(${end} - ${start}) / 10000")

# The checkpoint's trainer.pt (or, after a kill between the two renames
# of its swap, the one save_checkpoint moved aside), hashed: "" when none.
function(checkpoint_hash result)
  set(hash "")
  foreach(dir checkpoint checkpoint.old)
    if(hash STREQUAL "" AND EXISTS ${WORK_DIR}/killed/${dir}/trainer.pt)
      file(SHA256 ${WORK_DIR}/killed/${dir}/trainer.pt hash)
    endif()
  endforeach()
  set(${result} "${hash}" PARENT_SCOPE)
endfunction()

# Runs killed after `delay` seconds, one after another, each continuing from
# the checkpoint the previous one left (afresh while there is none). The
# first delay is 40 % of the uninterrupted run's time (at least 1 s); it
# grows by 10 % of that time after a kill that left no new checkpoint
# (start-up was slower than the kill), and by 0.37 s otherwise, so that the
# kills fall at different moments of the checkpoint cycle.
set(kills 0)
set(kills_after_progress 0)
set(finished FALSE)
math(EXPR delay_cs "${whole_cs} * 4 / 10")  # centiseconds
if(delay_cs LESS 100)
  set(delay_cs 100)
endif()
math(EXPR grow_cs "${whole_cs} / 10 + 1")
math(EXPR whole "${delay_cs} / 100")
math(EXPR frac "${delay_cs} % 100 + 100")  # two digits, after the "1"
string(SUBSTRING ${frac} 1 2 frac)
set(delay "${whole}.${frac}")
foreach(attempt RANGE 1 12)
  if(kills_after_progress GREATER_EQUAL 4)
    break()
  endif()
  checkpoint_hash(before)
  if(before STREQUAL "")
    set(resume "")
  else()
    set(resume --resume)
  endif()
  execute_process(COMMAND ${TOOL} ${tiny} --out ${WORK_DIR}/killed ${resume}
                  TIMEOUT ${delay} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    set(finished TRUE)  # it finished before the kill
    break()
  elseif(NOT rc MATCHES "timeout")
    message(FATAL_ERROR "run ${resume} after ${kills} kills failed (${rc}):\n"
                        "${out}${err}")
  endif()
  math(EXPR kills "${kills} + 1")
  checkpoint_hash(after)
  if(NOT after STREQUAL "" AND NOT after STREQUAL before)
    math(EXPR kills_after_progress "${kills_after_progress} + 1")
    math(EXPR delay_cs "${delay_cs} + 37")
  else()
    math(EXPR delay_cs "${delay_cs} + ${grow_cs}")
  endif()
  math(EXPR whole "${delay_cs} / 100")
  math(EXPR frac "${delay_cs} % 100 + 100")
  string(SUBSTRING ${frac} 1 2 frac)
  set(delay "${whole}.${frac}")
endforeach()
if(kills_after_progress LESS 2)
  message(FATAL_ERROR "only ${kills_after_progress} of ${kills} killed runs "
                      "had written a new checkpoint before the kill")
endif()
checkpoint_hash(last)
if(last STREQUAL "")
  message(FATAL_ERROR "no checkpoint after ${kills} kills")
endif()
if(NOT finished)
  execute_process(COMMAND ${TOOL} ${tiny} --out ${WORK_DIR}/killed --resume
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the final resume failed (${rc}):\n${out}${err}")
  endif()
endif()

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
loss_columns(${WORK_DIR}/killed/loss.csv killed_losses)
list(LENGTH whole_losses rows)
if(NOT rows EQUAL 121 OR NOT whole_losses STREQUAL killed_losses)
  message(FATAL_ERROR "after ${kills} kills the losses differ from the "
                      "uninterrupted run's:\n${whole_losses}\nvs\n"
                      "${killed_losses}")
endif()
message(STATUS "${kills} kills (${kills_after_progress} after a new "
               "checkpoint; the whole run took ${whole_cs} cs), resumed to "
               "the same ${rows} loss rows")
