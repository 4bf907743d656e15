"""Compare the README main job's rows of two runs (before/after a refactor) field by field.

    python reports/house/compare_main_job.py BEFORE/results.jsonl AFTER/results.jsonl
"""

import json
import statistics
import sys

a = [json.loads(line) for line in open(sys.argv[1])]
b = [json.loads(line) for line in open(sys.argv[2])]
ka = {(r['dataset'], r['strategy'], r['id']): r for r in a}
diffs = []
keys = ['answer', 'ref_nll', 'choice', 'completion_tokens', 'bytes_cloud_to_edge', 'system_tokens', 'user_tokens',
        'bertscore_f1', 'rouge_l', 'inference_memory_mb', 'upload_ratio', 'layer_sources', 'kv_source']
for r in b:
    o = ka[(r['dataset'], r['strategy'], r['id'])]
    for k in keys:
        if o.get(k) != r.get(k):
            diffs.append((r['dataset'], r['strategy'], r['id'], k, o.get(k), r.get(k)))
print(len(b), 'rows compared;', len(diffs), 'differences')
for d in diffs[:30]:
    print(d)
for k in ['ttft_s', 'ms_per_token']:
    for s in sorted({r['strategy'] for r in b}):
        x = [ka[(r['dataset'], r['strategy'], r['id'])][k] for r in b if r['strategy'] == s]
        y = [r[k] for r in b if r['strategy'] == s]
        print(k, s, round(statistics.median(x), 4), round(statistics.median(y), 4))
