# A fuzzer for the transpose pass: random NHWC-style graphs (transposes, SiLU, residuals, forks,
# reductions, Concat/Split, Q/DQ, graph outputs in the middle, opsets 11-18); each is optimized and
# checked on onnxruntime (outputs within 1e-5) and for byte-identical output on a second optimize.
# Run from the repository root: python -m scripts.oracles.fuzz_transposes LO HI  (seeds LO..HI-1)
import numpy as np, onnx
from onnx import helper
from tests.helpers import model, tinfo, init, feeds_for
from tests.conftest import run_ort
from onnxopt import optimize

PERMS=[[0,2,3,1],[0,3,1,2],[0,1,3,2],[0,2,1,3],[3,2,1,0],[1,0,2,3]]
def gen(seed, opset=None):
    rng=np.random.default_rng(seed)
    opset=opset or int(rng.choice([11,13,17,18]))
    sym=rng.random()<0.3
    S=4
    vals=[("x",[1,S,S,S])]  # (name, shape)
    nodes=[]; inits=[]; outs=[]; k=[0]
    shared=[]
    def nm(b):
        k[0]+=1; return f"{b}{k[0]}"
    def pick(shape=None):
        c=[v for v in vals if shape is None or v[1]==shape]
        return c[int(rng.integers(len(c)))] if rng.random()<0.5 else (c[-1] if c else None)
    for _ in range(int(rng.integers(3,14))):
        kind=rng.choice(["T","T","T","relu","silu","addc","addv","mulv","concat","reduce","softmax","slice","pad","split","out","sharedc","unsq","where","tread","tread","conv","conv","conv","conv","reshape","reshape","unsqueeze","gather","qdq","argmax"])
        v,sh=pick()
        o=nm("v")
        if kind=="T":
            p=PERMS[int(rng.integers(len(PERMS)))] if rng.random()<0.8 else list(rng.permutation(len(sh)))
            p=[int(a) for a in p][:len(sh)] if len(sh)==4 else [int(a) for a in rng.permutation(len(sh))]
            nodes.append(helper.make_node("Transpose",[v],[o],perm=p)); vals.append((o,[sh[a] for a in p]))
        elif kind=="relu":
            nodes.append(helper.make_node(rng.choice(["Relu","Neg","Sigmoid","Abs"]),[v],[o])); vals.append((o,sh))
        elif kind=="silu":
            s=nm("s"); nodes+= [helper.make_node("Sigmoid",[v],[s]),helper.make_node("Mul",[v,s] if rng.random()<.5 else [s,v],[o])]; vals.append((o,sh))
        elif kind in("addc","sharedc"):
            cs=[d if rng.random()<0.5 else 1 for d in sh][int(rng.integers(0,len(sh))):]
            ok=[q for q in shared if len(q[1])<=len(sh) and all(a in (1,b) for a,b in zip(q[1][::-1],sh[::-1]))]
            if kind=="sharedc" and ok and rng.random()<0.7:
                c,cs=ok[int(rng.integers(len(ok)))]
            else:
                c=nm("c"); inits.append(init(c,rng.standard_normal(cs).astype(np.float32))); shared.append((c,cs))
            out_sh=list(np.broadcast_shapes(tuple(sh),tuple(cs)))
            nodes.append(helper.make_node(rng.choice(["Add","Mul","Sub"]),[v,c] if rng.random()<.7 else [c,v],[o])); vals.append((o,out_sh))
        elif kind in("addv","mulv"):
            w=pick(sh)
            ins=[v,w[0]]; rng.shuffle(ins)
            nodes.append(helper.make_node("Add" if kind=="addv" else "Mul",ins,[o])); vals.append((o,sh))
        elif kind=="where":
            w=pick(sh); cnd=nm("cnd")
            nodes.append(helper.make_node("Greater",[v,w[0]],[cnd])); nodes.append(helper.make_node("Where",[cnd,v,w[0]],[o])); vals.append((o,sh))
        elif kind=="concat":
            w=pick(sh); a=int(rng.integers(len(sh)))
            nodes.append(helper.make_node("Concat",[v,w[0]],[o],axis=a)); s2=list(sh); s2[a]*=2; vals.append((o,s2))
        elif kind=="reduce":
            a=int(rng.integers(len(sh))); keep=int(rng.random()<0.7)
            if len(sh)<=2: keep=1
            if opset>=13:
                ax=nm("ax"); inits.append(init(ax,np.array([a],np.int64)))
                nodes.append(helper.make_node("ReduceSum",[v,ax],[o],keepdims=keep))
            else:
                nodes.append(helper.make_node("ReduceMax",[v],[o],keepdims=keep,axes=[a]))
            s2=list(sh); s2[a]=1
            if not keep: del s2[a]
            vals.append((o,s2))
        elif kind=="softmax":
            nodes.append(helper.make_node("Softmax",[v],[o],axis=int(rng.integers(len(sh))))); vals.append((o,sh))
        elif kind=="slice":
            a=int(rng.integers(len(sh)))
            if sh[a]<2: continue
            st,en,ax=nm("st"),nm("en"),nm("ax")
            inits+=[init(st,np.array([1],np.int64)),init(en,np.array([sh[a]],np.int64)),init(ax,np.array([a],np.int64))]
            nodes.append(helper.make_node("Slice",[v,st,en,ax],[o])); s2=list(sh); s2[a]-=1; vals.append((o,s2))
        elif kind=="conv":
            if len(sh)!=4: continue
            c=sh[1] if rng.random()<0.3 else sh[3]
            w=nm("w"); inits.append(init(w,(rng.standard_normal((4,c,1,1))*0.5).astype(np.float32)))
            t1,cv=nm("t"),nm("cv")
            if c==sh[1] and rng.random()<0.5:
                nodes.append(helper.make_node("Conv",[v,w],[o])); vals.append((o,[sh[0],4,sh[2],sh[3]]))
            else:
                if c!=sh[3]: continue
                nodes+=[helper.make_node("Transpose",[v],[t1],perm=[0,3,1,2]),helper.make_node("Conv",[t1,w],[cv]),helper.make_node("Transpose",[cv],[o],perm=[0,2,3,1])]
                vals.append((o,[sh[0],sh[1],sh[2],4]))
        elif kind=="reshape":
            r=len(sh)
            mode=rng.integers(3)
            if mode==0:   # insert 1s
                tgt=list(sh); 
                for _ in range(int(rng.integers(1,3))): tgt.insert(int(rng.integers(len(tgt)+1)),1)
            elif mode==1 and r>=2:  # merge adjacent
                a=int(rng.integers(r-1)); tgt=sh[:a]+[sh[a]*sh[a+1]]+sh[a+2:]
            else:  # split a dim
                a=int(rng.integers(r))
                if sh[a]%2 or sh[a]<4: continue
                tgt=sh[:a]+[2,sh[a]//2]+sh[a+1:]
            if rng.random()<0.3 and tgt[0]==sh[0]: tgt=[0]+tgt[1:]
            real=[sh[0] if (t==0 and i==0) else t for i,t in enumerate(tgt)]
            if rng.random()<0.3:
                j=int(rng.integers(len(tgt))); tgt=list(tgt); tgt[j]=-1
            sn=nm("shape"); inits.append(init(sn,np.array(tgt,np.int64)))
            nodes.append(helper.make_node("Reshape",[v,sn],[o])); vals.append((o,real))
        elif kind=="unsqueeze":
            a=int(rng.integers(len(sh)+1)); ax=nm("ax")
            if opset>=13:
                inits.append(init(ax,np.array([a],np.int64))); nodes.append(helper.make_node("Unsqueeze",[v,ax],[o]))
            else:
                nodes.append(helper.make_node("Unsqueeze",[v],[o],axes=[a]))
            vals.append((o,sh[:a]+[1]+sh[a:]))
        elif kind=="gather":
            a=int(rng.integers(len(sh))); idx=nm("idx")
            iv=rng.integers(0,sh[a],size=int(rng.integers(1,3))) if rng.random()<0.6 else np.array(int(rng.integers(0,sh[a])))
            inits.append(init(idx,iv.astype(np.int64)))
            nodes.append(helper.make_node("Gather",[v,idx],[o],axis=a)); vals.append((o,sh[:a]+list(iv.shape)+sh[a+1:]))
        elif kind=="qdq":
            if opset<13: continue
            a=int(rng.integers(len(sh))); sc,zp,q=nm("sc"),nm("zp"),nm("q")
            inits+=[init(sc,rng.uniform(0.01,0.1,sh[a]).astype(np.float32)),init(zp,np.zeros(sh[a],np.uint8)+128)]
            nodes+=[helper.make_node("QuantizeLinear",[v,sc,zp],[q],axis=a),helper.make_node("DequantizeLinear",[q,sc,zp],[o],axis=a)]
            vals.append((o,sh))
        elif kind=="argmax":
            a=int(rng.integers(len(sh))); keep=int(rng.random()<0.5)
            if len(sh)<=2: keep=1
            c2=nm("am"); nodes.append(helper.make_node("ArgMax",[v],[c2],axis=a,keepdims=keep)); nodes.append(helper.make_node("Cast",[c2],[o],to=1))
            s2=list(sh); s2[a]=1
            if not keep: del s2[a]
            vals.append((o,s2))
        elif kind=="tread":
            p=PERMS[int(rng.integers(len(PERMS)))]
            if len(sh)!=4 or len(set(sh))!=1: continue
            z=nm("z"); nodes.append(helper.make_node("Transpose",[v],[z],perm=p)); nodes.append(helper.make_node(rng.choice(["Add","Mul","Sub"]),[v,z] if rng.random()<.5 else [z,v],[o])); vals.append((z,sh)); vals.append((o,sh))
        elif kind=="softmax" and opset<13: continue
        elif kind=="pad":
            pads=[int(q) for q in rng.integers(0,2,2*len(sh))]; pn=nm("p"); inits.append(init(pn,np.array(pads,np.int64)))
            nodes.append(helper.make_node("Pad",[v,pn],[o])); vals.append((o,[d+pads[i]+pads[len(sh)+i] for i,d in enumerate(sh)]))
        elif kind=="split":
            a=int(rng.integers(len(sh)))
            if sh[a]%2: continue
            o2=nm("v"); nodes.append(helper.make_node("Split",[v],[o,o2],axis=a,num_outputs=2) if opset>=18 else helper.make_node("Split",[v],[o,o2],axis=a))
            s2=list(sh); s2[a]//=2; vals.append((o,s2)); vals.append((o2,s2))
        elif kind=="unsq":
            if len(sh)!=4: continue
            a=int(rng.integers(4)); ax=nm("ax")
            if opset>=13: inits.append(init(ax,np.array([a],np.int64)))
            nodes.append(helper.make_node("Squeeze" if sh[a]==1 else "Relu",[v,ax] if sh[a]==1 and opset>=13 else [v],[o],**({"axes":[a]} if sh[a]==1 and opset<13 else {})))
            s2=list(sh); 
            if sh[a]==1: del s2[a]
            vals.append((o,s2))
        elif kind=="out":
            if v!="x" and v not in [q for q in outs]: outs.append(v)
    used={i for n in nodes for i in n.input}
    for n_,_s in vals[1:]:
        if n_ not in used and n_ not in outs and rng.random()<0.3: outs.append(n_)
    last=vals[-1][0]
    if last!="x" and last not in outs: outs.append(last)
    if not outs:
        return None
    m=model(nodes,[tinfo("x",["N",S,S,S] if sym else [1,S,S,S])],[helper.make_tensor_value_info(n,1,None) for n in outs],inits,opset=opset)
    m=onnx.shape_inference.infer_shapes(m,strict_mode=True)
    return m

def check(seed):
    m=gen(seed)
    if m is None: return None
    feeds=feeds_for(m)
    a=run_ort(m,feeds)
    try:
        out=optimize(m)
        out2=optimize(m)
    except Exception as e:
        return f"seed {seed}: optimize raised {type(e).__name__}: {e}"
    if out.SerializeToString()!=out2.SerializeToString():
        return f"seed {seed}: nondeterministic"
    try:
        b=run_ort(out,feeds)
    except Exception as e:
        return f"seed {seed}: ort failed on output: {str(e)[:200]}"
    for x,y in zip(a,b):
        if x.shape!=y.shape or not np.allclose(x,y,rtol=1e-5,atol=1e-5):
            return f"seed {seed}: outputs differ"
    return None

def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.fuzz_transposes",
                                description="Fuzz the transpose pass on random NHWC-style graphs (seeds LO..HI-1).")
    p.add_argument("lo", type=int)
    p.add_argument("hi", type=int)
    args = p.parse_args(argv)
    lo, hi = args.lo, args.hi
    for s in range(lo,hi):
        try:
            r=check(s)
        except Exception as e:
            r=f"seed {s}: gen/ort error {type(e).__name__}: {str(e)[:150]}"
        if r: print(r, flush=True)
    print("done",lo,hi)


if __name__=="__main__":
    main()
