. bench/device_setup.sh
python3 bench/.prof/ev2_probe.py
ncu --clock-control none -k regex:'entropy_(en|de)code' -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section InstructionStats python3 bench/.prof/ev2_probe.py > $OUT/ncu_sum.log 2>&1
grep -E "entropy_|Duration|SM Busy|Issue Slots|Executed Ipc|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles Per Issued|Executed Instructions  |Achieved Occ|Registers|Stall|Memory Throughput" $OUT/ncu_sum.log | head -60
ncu --clock-control none -k regex:'entropy_decode' -c 1 --section SourceCounters --page source --print-source sass python3 bench/.prof/ev2_probe.py > $OUT/ncu_dec_src.log 2>&1
ncu --clock-control none -k regex:'entropy_encode' -c 1 --section SourceCounters --page source --print-source sass python3 bench/.prof/ev2_probe.py > $OUT/ncu_enc_src.log 2>&1
wc -l $OUT/*.log
cd $OUT && tar czf ncu.tgz *.log
