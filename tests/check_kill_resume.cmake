# Checks that mha-train survives SIGKILL (issue 22, item 6): a run is
# killed at several moments (CMake's execute_process TIMEOUT kills the
# process with SIGKILL), each time resumed from its last complete checkpoint
# (or started afresh when it had written none yet), and finally resumed to
# the end; its loss.csv must then equal the uninterrupted run's (columns
# step, lr, train_loss, val_loss, not the timings).
# Variables: TOOL (the mha-train executable), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

set(steps 480)
set(tiny --max-len 6 --d-model 32 --heads 2 --layers 1 --ff 64 --dropout 0.1
    --batch-size 32 --warmup 4 --eval-every 10 --checkpoint-every 3
    --eval-sequences 50 --quiet)

# Wall time of one run of `steps` steps into `dir`, in centiseconds.
function(timed_run steps dir result)
  string(TIMESTAMP start "%s%f" UTC)
  execute_process(COMMAND ${TOOL} ${tiny} --steps ${steps} --out ${dir}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP end "%s%f" UTC)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the uninterrupted ${steps}-step run failed (${rc}):"
                        "\n${out}${err}")
  endif()
  math(EXPR cs "(${end} - ${start}) / 10000")
  set(${result} ${cs} PARENT_SCOPE)
endfunction()

# Start-up (a 4-step run: loading, data, the final evaluation) and the
# whole run; each kill is timed from both. Timed from the whole run alone
# (120 steps) the kills missed: start-up took 1.5 of 2 s with LibTorch 2.14
# (sid chroot), so a resumed run outran its kill 3 times in 5, and on 1.13
# here a 1.6 s run left one kill after progress.
# The whole run first, so that the start-up is timed as the killed runs
# meet it, with the libraries already in the page cache.
timed_run(${steps} ${WORK_DIR}/whole whole_cs)
timed_run(4 ${WORK_DIR}/start_up startup_cs)  # 4: the warm-up steps
math(EXPR train_cs "${whole_cs} - ${startup_cs}")
if(train_cs LESS 20)
  set(train_cs 20)
endif()

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

# Runs killed one after another, each continuing from the checkpoint the
# previous one left (afresh while there is none). Each is killed after the
# start-up plus a sixth of the training time, give or take (12-22 %, a
# different share each time, so that the kills fall at different moments
# of the checkpoint cycle): about six runs make the progress of one. A
# kill that left no new checkpoint (start-up slower than measured) makes
# the next runs wait 10 % of the whole run longer.
set(kills 0)
set(kills_after_progress 0)
set(finished FALSE)
set(late_cs 0)
foreach(attempt RANGE 1 12)
  if(kills_after_progress GREATER_EQUAL 4)
    break()
  endif()
  math(EXPR share "12 + (${attempt} * 7) % 11")  # percent of the training
  math(EXPR delay_cs
       "${startup_cs} + ${train_cs} * ${share} / 100 + ${late_cs}")
  math(EXPR whole "${delay_cs} / 100")
  math(EXPR frac "${delay_cs} % 100 + 100")  # two digits, after the "1"
  string(SUBSTRING ${frac} 1 2 frac)
  set(delay "${whole}.${frac}")
  checkpoint_hash(before)
  if(before STREQUAL "")
    set(resume "")
  else()
    set(resume --resume)
  endif()
  execute_process(COMMAND ${TOOL} ${tiny} --steps ${steps}
                          --out ${WORK_DIR}/killed ${resume}
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
  else()
    math(EXPR late_cs "${late_cs} + ${whole_cs} / 10 + 1")
  endif()
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
  execute_process(COMMAND ${TOOL} ${tiny} --steps ${steps}
                          --out ${WORK_DIR}/killed --resume
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
math(EXPR expected_rows "${steps} + 1")  # a header, a row per step
if(NOT rows EQUAL expected_rows OR NOT whole_losses STREQUAL killed_losses)
  message(FATAL_ERROR "after ${kills} kills the losses differ from the "
                      "uninterrupted run's:\n${whole_losses}\nvs\n"
                      "${killed_losses}")
endif()
message(STATUS "${kills} kills (${kills_after_progress} after a new "
               "checkpoint; start-up ${startup_cs} cs, the whole run "
               "${whole_cs} cs), resumed to the same ${rows} loss rows")
