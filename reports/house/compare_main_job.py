import json,sys
a=[json.loads(l) for l in open('/tmp/before/runs/eval-default/results.jsonl')]
b=[json.loads(l) for l in open('/tmp/after/runs/eval-default/results.jsonl')]
ka={(r['dataset'],r['strategy'],r['id']):r for r in a}
same_ans=same_nll=0; diffs=[]
keys=['answer','ref_nll','choice','completion_tokens','bytes_cloud_to_edge','system_tokens','user_tokens','bertscore_f1','rouge_l','inference_memory_mb','upload_ratio','layer_sources','kv_source']
for r in b:
    o=ka[(r['dataset'],r['strategy'],r['id'])]
    for k in keys:
        if o.get(k)!=r.get(k): diffs.append((r['dataset'],r['strategy'],r['id'],k,o.get(k),r.get(k)))
print(len(b),'rows compared;', len(diffs),'differences')
for d in diffs[:30]: print(d)
import statistics
for k in ['ttft_s','ms_per_token']:
    for s in sorted({r['strategy'] for r in b}):
        x=[ka[(r['dataset'],r['strategy'],r['id'])][k] for r in b if r['strategy']==s]; y=[r[k] for r in b if r['strategy']==s]
        print(k,s,round(statistics.median(x),4),round(statistics.median(y),4))
