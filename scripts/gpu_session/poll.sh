# progress of the training daemon
grep -v "Loading weights\|Converting\|FutureWarning\|forward_call" /tmp/daemon.log | tail -${1:-8} | cut -c1-400
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
