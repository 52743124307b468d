#!/usr/bin/env bash
# Issue 47, second round (one H200): the classifier's overheads (lab/classifier/overheads.py), then where the
# bf16 step with the fused classifier goes (lab/profile_step.py), against eager + compile.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 lab/classifier/overheads.py 2>&1 | grep -v Warning
python3 lab/profile_step.py configs/gpt2_124m.py --variants=eager+compile,fused+cls+compile 2>&1 | grep -v Warning | tail -60
