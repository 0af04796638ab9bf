# final call: bring the head, the answers and the logs back through $RET (8 files, < 16 MiB each)
cp /tmp/daemon.log $R/ 2>/dev/null
if [ -f $R/final/head.json ]; then tar -cf - -C $R final | split -b 15M - $RET/head.tar.
else ck=$(ls -t $D/work/runs/*/checkpoint.pt | head -1); mkdir -p $R/ckpt; cp $ck $R/ckpt/;
     cp $R/final/status.json $R/ckpt/ 2>/dev/null; tar -cf - -C $R ckpt | split -b 15M - $RET/ckpt.tar.; fi
xz -T16 -6 -c $D/work/data/responses.jsonl | split -b 15M - $RET/responses.jsonl.xz.
cp $D/work/features/meta.json $R/features-meta.json 2>/dev/null
tar -czf $RET/logs.tgz -C $R --exclude final --exclude ckpt --exclude 'g/model.safetensors*' --exclude 'cal/model.safetensors*' .
ls -la $RET
