"""Options as objects (``onnxopt.options``): the old keywords, flags and config keys keep their
meaning, and a new option is written once (a flag, a config key and a keyword).

The lists below are those of commit 7558f2d, taken from its code (``git archive 7558f2d``: the
signatures of ``optimize`` and ``quantize``, every parser's option strings, ``config.SCHEMA``,
what each parser makes of a command line, and the ``optimize()``/``quantize()`` call the command
line made), written here literally so that a change to any of them fails here."""

from __future__ import annotations

import dataclasses
import importlib
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt.quantize.api as quantize_api
from onnxopt import cli, options
from onnxopt.api import optimize
from onnxopt.cli import config
from onnxopt.errors import UsageError
from onnxopt.options import (LayoutOptions, OptimizeOptions, QuantizeOptions, RewriteOptions, TargetOptions,
                             VerifyOptions, option)
from onnxopt.quantize.api import quantize
from onnxopt.cli import optimize as CLI_OPTIMIZE  # (the module whose optimize() the main command calls)

# --------------------------------------------------------------------------------------------
# At 7558f2d

OPTIMIZE_KEYWORDS = ['rules', 'extra_rules', 'disable', 'target', 'output', 'external_data', 'genai', 'max_rewrites', 'fold_size_limit',
 'fold_input_limit', 'graph_passes', 'check', 'inplace', 'return_report', 'stop_after', 'verify', 'verify_options',
 'outputs', 'strict', 'input_shapes', 'exact', 'progress', 'quantize', 'precision', 'input_layout', 'output_layout',
 'input_preprocess', 'diff']

QUANTIZE_KEYWORDS = ['output', 'method', 'per_channel', 'target', 'exclude', 'fidelity', 'keep_float', 'reduce_range', 'workers',
 'held_out', 'input_shapes', 'external_data', 'check', 'return_report', 'outputs', 'strict', 'progress',
 'method_options', 'threads', 'latency_budget']

FLAGS = {'optimize': ['--atol', '--builtin-rules', '--config', '--decode', '--decode-prompts', '--diff', '--disable', '--exact', '--external-data',
              '--fold-size-limit', '--genai', '--help', '--input-layout', '--input-preprocess', '--input-shape', '--inputs',
              '--int-range', '--json', '--latency-budget', '--list-rules', '--max-rewrites', '--no-builtin-rules',
              '--no-exact', '--no-quiet', '--no-strict', '--output', '--output-layout', '--padding', '--precision',
              '--provider-option', '--quiet', '--report', '--rtol', '--rules', '--runs', '--seed', '--single-file',
              '--strict', '--target', '--threads', '--verify', '--version', '--warmup', '-c', '-h', '-o', '-q'],
 'verify': ['--atol', '--decode', '--decode-prompts', '--help', '--input-shape', '--inputs', '--int-range', '--json', '--latency-budget',
            '--min-sqnr', '--no-quiet', '--provider-option', '--providers', '--quiet', '--rtol', '--runs', '--seed',
            '--threads', '--warmup', '-h', '-q'],
 'bisect': ['--atol', '--builtin-rules', '--disable', '--exact', '--fix-input-shape', '--fold-size-limit', '--help',
            '--input-shape', '--inputs', '--int-range', '--json', '--max-rewrites', '--no-builtin-rules',
            '--no-exact', '--no-quiet', '--no-strict', '--provider', '--quiet', '--rtol', '--rules', '--seed',
            '--strict', '--target', '-h', '-q'],
 'quantize': ['--calib', '--config', '--exclude', '--fidelity', '--held-out', '--help', '--input-shape', '--json',
              '--keep-float', '--latency-budget', '--method', '--no-fidelity', '--no-quiet', '--output',
              '--per-channel', '--per-tensor', '--percentile', '--quiet', '--reduce-range', '--strict', '--target',
              '--threads', '--workers', '-c', '-h', '-o', '-q'],
 'diff': ['--help', '--html', '--json', '--model-explorer', '--no-browser', '--port', '--quiet', '--verify-report',
          '-h', '-q'],
 'inspect': ['--device', '--help', '--html', '--input-shape', '--json', '--quiet', '--top', '-h', '-q']}

CONFIG_KEYS = [['target', 'string', '--target', {'optimize': ['target'], 'quantize': ['target']}],
 ['precision', 'string', '--precision', {'optimize': ['precision']}],
 ['exact', 'boolean', '--exact', {'optimize': ['exact']}],
 ['max_rewrites', 'integer', '--max-rewrites', {'optimize': ['max_rewrites']}],
 ['fold_size_limit', 'integer', '--fold-size-limit', {'optimize': ['fold_size_limit']}],
 ['strict', 'boolean', '--strict', {'optimize': ['strict'], 'quantize': ['strict']}],
 ['rules', 'strings', '--rules', {'optimize': ['rules']}],
 ['disable', 'strings', '--disable', {'optimize': ['disable']}],
 ['no_builtin_rules', 'boolean', '--no-builtin-rules', {'optimize': ['no_builtin_rules']}],
 ['external_data', 'boolean|string', '--external-data', {'optimize': ['external_data', 'single_file']}],
 ['genai', 'string', '--genai', {'optimize': ['genai']}],
 ['input_shapes', 'table', '--input-shape', {'optimize': ['input_shape'], 'quantize': ['input_shape']}],
 ['layout.input', 'string|table', '--input-layout', {'optimize': ['input_layout']}],
 ['layout.output', 'string|table', '--output-layout', {'optimize': ['output_layout']}],
 ['padding', 'string', '--padding', {'optimize': ['padding']}],
 ['layout.preprocess', 'table', '--input-preprocess', {'optimize': ['input_preprocess']}],
 ['verify.providers', 'string|strings', '--verify', {'optimize': ['verify']}],
 ['verify.rtol', 'number', '--rtol', {'optimize': ['rtol']}],
 ['verify.atol', 'number', '--atol', {'optimize': ['atol']}],
 ['verify.runs', 'integer', '--runs', {'optimize': ['runs']}],
 ['verify.latency_budget', 'number', '--latency-budget', {'optimize': ['latency_budget']}],
 ['verify.warmup', 'integer', '--warmup', {'optimize': ['warmup']}],
 ['verify.threads', 'integer', '--threads', {'optimize': ['threads']}],
 ['verify.seed', 'integer', '--seed', {'optimize': ['seed']}],
 ['verify.inputs', 'string', '--inputs', {'optimize': ['inputs']}],
 ['verify.int_ranges', 'table', '--int-range', {'optimize': ['int_range']}],
 ['verify.provider_options', 'table', '--provider-option', {'optimize': ['provider_option']}],
 ['verify.decode', 'integer', '--decode', {'optimize': ['decode']}],
 ['verify.decode_prompts', 'string', '--decode-prompts', {'optimize': ['decode_prompts']}],
 ['report.json', 'string', '--json', {'optimize': ['json'], 'quantize': ['json']}],
 ['report.quiet', 'boolean', '--quiet', {'optimize': ['quiet'], 'quantize': ['quiet']}],
 ['report.diff', 'string', '--diff', {'optimize': ['diff']}],
 ['report.html', 'string', '--report', {'optimize': ['report']}],
 ['quantize.calibration', 'string', '--calib', {'quantize': ['calib']}],
 ['quantize.method', 'string', '--method', {'quantize': ['method']}],
 ['quantize.per_channel', 'boolean', '--per-channel', {'quantize': ['per_channel']}],
 ['quantize.exclude', 'strings', '--exclude', {'quantize': ['exclude']}],
 ['quantize.fidelity', 'number|false', '--fidelity', {'quantize': ['fidelity']}],
 ['quantize.keep_float', 'string', '--keep-float', {'quantize': ['keep_float']}],
 ['quantize.threads', 'integer', '--threads', {'quantize': ['threads']}],
 ['quantize.latency_budget', 'number', '--latency-budget', {'quantize': ['latency_budget']}],
 ['quantize.reduce_range', 'boolean', '--reduce-range', {'quantize': ['reduce_range']}],
 ['quantize.workers', 'integer', '--workers', {'quantize': ['workers']}],
 ['quantize.held_out', 'integer', '--held-out', {'quantize': ['held_out']}],
 ['quantize.percentile', 'number', '--percentile', {'quantize': ['percentile']}]]

PARSED = {'optimize': [[['m.onnx', '-o', 'o.onnx', '--disable', 'a', '--disable', 'b', '--rules', 'r.py', '--no-builtin-rules',
                '--target', 'ort-cpu', '--exact', '--max-rewrites', '5', '--strict', '--fold-size-limit', '7',
                '--single-file', '--precision', 'fp16', '--verify', 'cpu', '--input-layout', 'x=NHWC',
                '--output-layout', 'y=NHWC', '--input-preprocess', 'x=uint8,HWC', '--inputs', 'f.npz',
                '--input-shape', 'x=1x3', '--int-range', 'ids=0:3', '--seed', '3', '--rtol', '0.1', '--atol', '0.2',
                '--runs', '4', '--latency-budget', '2.5', '--warmup', '2', '--threads', '3', '--provider-option',
                'cuda:a=1', '--json', 'r.json', '-q', '--diff', 'd.html', '--report', 'p.html', '-c', 'c.toml'],
               {'input': 'm.onnx',
                'output': 'o.onnx',
                'list_rules': False,
                'disable': ['a', 'b'],
                'rules': ['r.py'],
                'no_builtin_rules': True,
                'target': 'ort-cpu',
                'exact': True,
                'max_rewrites': 5,
                'strict': True,
                'fold_size_limit': 7,
                'external_data': None,
                'genai': None,
                'single_file': True,
                'precision': 'fp16',
                'padding': 'any',
                'verify': 'cpu',
                'input_layout': ['x=NHWC'],
                'output_layout': ['y=NHWC'],
                'input_preprocess': ['x=uint8,HWC'],
                'inputs': 'f.npz',
                'input_shape': ['x=1x3'],
                'int_range': ['ids=0:3'],
                'seed': 3,
                'rtol': 0.1,
                'atol': 0.2,
                'runs': 4,
                'latency_budget': 2.5,
                'warmup': 2,
                'threads': 3,
                'provider_option': ['cuda:a=1'],
                'decode': None,
                'decode_prompts': None,
                'json': 'r.json',
                'quiet': True,
                'diff': 'd.html',
                'report': 'p.html',
                'config': 'c.toml'}],
              [['m.onnx', '--external-data', 'w.bin', '--builtin-rules', '--no-exact', '--no-strict', '--no-quiet',
                '--list-rules'],
               {'input': 'm.onnx',
                'output': None,
                'list_rules': True,
                'disable': [],
                'rules': [],
                'no_builtin_rules': False,
                'target': None,
                'exact': False,
                'max_rewrites': None,
                'strict': False,
                'fold_size_limit': 1048576,
                'external_data': 'w.bin',
                'genai': None,
                'single_file': False,
                'precision': 'fp32',
                'padding': 'any',
                'verify': None,
                'input_layout': [],
                'output_layout': [],
                'input_preprocess': [],
                'inputs': None,
                'input_shape': [],
                'int_range': [],
                'seed': 0,
                'rtol': None,
                'atol': None,
                'runs': 200,
                'latency_budget': 10.0,
                'warmup': 5,
                'threads': 1,
                'provider_option': [],
                'decode': None,
                'decode_prompts': None,
                'json': None,
                'quiet': False,
                'diff': None,
                'report': None,
                'config': None}],
              [['m.onnx', '--external-data'],
               {'input': 'm.onnx',
                'output': None,
                'list_rules': False,
                'disable': [],
                'rules': [],
                'no_builtin_rules': False,
                'target': None,
                'exact': False,
                'max_rewrites': None,
                'strict': None,
                'fold_size_limit': 1048576,
                'external_data': True,
                'genai': None,
                'single_file': False,
                'precision': 'fp32',
                'padding': 'any',
                'verify': None,
                'input_layout': [],
                'output_layout': [],
                'input_preprocess': [],
                'inputs': None,
                'input_shape': [],
                'int_range': [],
                'seed': 0,
                'rtol': None,
                'atol': None,
                'runs': 200,
                'latency_budget': 10.0,
                'warmup': 5,
                'threads': 1,
                'provider_option': [],
                'decode': None,
                'decode_prompts': None,
                'json': None,
                'quiet': False,
                'diff': None,
                'report': None,
                'config': None}],
              [['m.onnx'],
               {'input': 'm.onnx',
                'output': None,
                'list_rules': False,
                'disable': [],
                'rules': [],
                'no_builtin_rules': False,
                'target': None,
                'exact': False,
                'max_rewrites': None,
                'strict': None,
                'fold_size_limit': 1048576,
                'external_data': None,
                'genai': None,
                'single_file': False,
                'precision': 'fp32',
                'padding': 'any',
                'verify': None,
                'input_layout': [],
                'output_layout': [],
                'input_preprocess': [],
                'inputs': None,
                'input_shape': [],
                'int_range': [],
                'seed': 0,
                'rtol': None,
                'atol': None,
                'runs': 200,
                'latency_budget': 10.0,
                'warmup': 5,
                'threads': 1,
                'provider_option': [],
                'decode': None,
                'decode_prompts': None,
                'json': None,
                'quiet': False,
                'diff': None,
                'report': None,
                'config': None}]],
 'verify': [[['a', 'b', '--providers', 'cpu,cuda', '--min-sqnr', '30', '--inputs', 'f.npz', '--input-shape', 'x=1x3',
              '--int-range', 'i=0:1', '--seed', '1', '--rtol', '1', '--atol', '2', '--runs', '3', '--latency-budget',
              '1', '--warmup', '2', '--threads', '0', '--provider-option', 'cpu:x=1', '--json', 'j', '-q'],
             {'original': 'a',
              'optimized': 'b',
              'providers': 'cpu,cuda',
              'min_sqnr': 30.0,
              'inputs': 'f.npz',
              'input_shape': ['x=1x3'],
              'int_range': ['i=0:1'],
              'seed': 1,
              'rtol': 1.0,
              'atol': 2.0,
              'runs': 3,
              'latency_budget': 1.0,
              'warmup': 2,
              'threads': 0,
              'provider_option': ['cpu:x=1'],
              'decode': None,
              'decode_prompts': None,
              'json': 'j',
              'quiet': True}],
            [['a', 'b', '--no-quiet'],
             {'original': 'a',
              'optimized': 'b',
              'providers': 'cpu',
              'min_sqnr': None,
              'inputs': None,
              'input_shape': [],
              'int_range': [],
              'seed': 0,
              'rtol': None,
              'atol': None,
              'runs': 200,
              'latency_budget': 10.0,
              'warmup': 5,
              'threads': 1,
              'provider_option': [],
              'decode': None,
              'decode_prompts': None,
              'json': None,
              'quiet': False}],
            [['a', 'b'],
             {'original': 'a',
              'optimized': 'b',
              'providers': 'cpu',
              'min_sqnr': None,
              'inputs': None,
              'input_shape': [],
              'int_range': [],
              'seed': 0,
              'rtol': None,
              'atol': None,
              'runs': 200,
              'latency_budget': 10.0,
              'warmup': 5,
              'threads': 1,
              'provider_option': [],
              'decode': None,
              'decode_prompts': None,
              'json': None,
              'quiet': False}]],
 'bisect': [[['m', '--provider', 'cuda', '--disable', 'a', '--rules', 'r.py', '--no-builtin-rules', '--target',
              'cuda', '--exact', '--max-rewrites', '3', '--strict', '--fold-size-limit', '9', '--fix-input-shape',
              'x=1', '--inputs', 'f', '--input-shape', 'x=2', '--int-range', 'i=0:1', '--seed', '2', '--rtol', '1',
              '--atol', '1', '--json', 'j', '-q'],
             {'model': 'm',
              'provider': 'cuda',
              'disable': ['a'],
              'rules': ['r.py'],
              'no_builtin_rules': True,
              'target': 'cuda',
              'exact': True,
              'max_rewrites': 3,
              'strict': True,
              'fold_size_limit': 9,
              'fix_input_shape': ['x=1'],
              'inputs': 'f',
              'input_shape': ['x=2'],
              'int_range': ['i=0:1'],
              'seed': 2,
              'rtol': 1.0,
              'atol': 1.0,
              'json': 'j',
              'quiet': True}],
            [['m', '--builtin-rules', '--no-exact', '--no-strict', '--no-quiet'],
             {'model': 'm',
              'provider': 'cpu',
              'disable': [],
              'rules': [],
              'no_builtin_rules': False,
              'target': None,
              'exact': False,
              'max_rewrites': None,
              'strict': False,
              'fold_size_limit': 1048576,
              'fix_input_shape': [],
              'inputs': None,
              'input_shape': [],
              'int_range': [],
              'seed': 0,
              'rtol': None,
              'atol': None,
              'json': None,
              'quiet': False}],
            [['m'],
             {'model': 'm',
              'provider': 'cpu',
              'disable': [],
              'rules': [],
              'no_builtin_rules': False,
              'target': None,
              'exact': False,
              'max_rewrites': None,
              'strict': None,
              'fold_size_limit': 1048576,
              'fix_input_shape': [],
              'inputs': None,
              'input_shape': [],
              'int_range': [],
              'seed': 0,
              'rtol': None,
              'atol': None,
              'json': None,
              'quiet': False}]],
 'quantize': [[['m', '-o', 'q', '--calib', 'c', '--method', 'entropy', '--per-tensor', '--target', 'portable',
                '--exclude', 'Conv', 'n1', '--fidelity', '30', '--keep-float', 'never', '--threads', '2',
                '--latency-budget', '3', '--reduce-range', '--workers', '2', '--held-out', '4', '--percentile',
                '99.9', '--input-shape', 'x=1', '--strict', '--json', 'j', '-q', '-c', 'c.toml'],
               {'input': 'm',
                'output': 'q',
                'calib': 'c',
                'method': 'entropy',
                'per_channel': False,
                'target': 'portable',
                'exclude': ['Conv', 'n1'],
                'fidelity': 30.0,
                'keep_float': 'never',
                'threads': 2,
                'latency_budget': 3.0,
                'reduce_range': True,
                'workers': 2,
                'held_out': 4,
                'percentile': 99.9,
                'input_shape': ['x=1'],
                'strict': True,
                'json': 'j',
                'quiet': True,
                'config': 'c.toml'}],
              [['m', '-o', 'q', '--per-channel', '--no-fidelity', '--no-quiet'],
               {'input': 'm',
                'output': 'q',
                'calib': None,
                'method': 'minmax',
                'per_channel': True,
                'target': 'ort-cpu',
                'exclude': [],
                'fidelity': None,
                'keep_float': 'auto',
                'threads': 1,
                'latency_budget': 10.0,
                'reduce_range': None,
                'workers': 1,
                'held_out': None,
                'percentile': None,
                'input_shape': [],
                'strict': None,
                'json': None,
                'quiet': False,
                'config': None}],
              [['m', '-o', 'q'],
               {'input': 'm',
                'output': 'q',
                'calib': None,
                'method': 'minmax',
                'per_channel': True,
                'target': 'ort-cpu',
                'exclude': [],
                'fidelity': 20.0,
                'keep_float': 'auto',
                'threads': 1,
                'latency_budget': 10.0,
                'reduce_range': None,
                'workers': 1,
                'held_out': None,
                'percentile': None,
                'input_shape': [],
                'strict': None,
                'json': None,
                'quiet': False,
                'config': None}]],
 'diff': [[['a', 'b', '--html', 'h', '--json', 'j', '--model-explorer', 'me', '--verify-report', 'v', '--port', '9',
            '--no-browser', '-q'],
           {'before': 'a',
            'after': 'b',
            'html': 'h',
            'json': 'j',
            'me_json': 'me',
            'verify_report': 'v',
            'port': 9,
            'no_browser': True,
            'quiet': True}],
          [['a', 'b'],
           {'before': 'a',
            'after': 'b',
            'html': None,
            'json': None,
            'me_json': None,
            'verify_report': None,
            'port': None,
            'no_browser': False,
            'quiet': False}]],
 'inspect': [[['m', '--input-shape', 'x=1', '--device', 'h100-sxm', '--top', '3', '--json', 'j', '--html', 'h', '-q'],
              {'input': 'm',
               'input_shape': ['x=1'],
               'device': 'h100-sxm',
               'top': 3,
               'json': 'j',
               'html': 'h',
               'quiet': True}],
             [['m'],
              {'input': 'm',
               'input_shape': [],
               'device': None,
               'top': 10,
               'json': None,
               'html': None,
               'quiet': False}]]}

CALLS = [[['m.onnx', '-o', 'o.onnx', '--disable', 'a', '--disable', 'b', '--rules', 'r.py', '--no-builtin-rules', '--target',
   'ort-cpu', '--exact', '--max-rewrites', '5', '--strict', '--fold-size-limit', '7', '--single-file', '--precision',
   'fp32', '--verify', 'cpu', '--input-layout', 'x=NHWC', '--output-layout', 'y=NHWC', '--input-preprocess',
   'x=uint8,HWC', '--input-shape', 'x=1x3x4x4', '--int-range', 'ids=0:3', '--seed', '3', '--rtol', '0.1', '--atol',
   '0.2', '--runs', '4', '--latency-budget', '2.5', '--warmup', '2', '--threads', '3', '--provider-option', 'cpu:a=1',
   '-q'],
  {'disable': ['a', 'b'],
   'exact': True,
   'external_data': False,
   'genai': None,
   'extra_rules': ['mine'],
   'fold_size_limit': 7,
   'input_layout': ['x=NHWC'],
   'input_preprocess': ['x=uint8,HWC'],
   'input_shapes': {'x': [1, 3, 4, 4]},
   'max_rewrites': 5,
   'output': 'o.onnx',
   'output_layout': ['y=NHWC'],
   'outputs': '<outputs>',
   'precision': 'fp32',
   'padding': 'any',
   'progress': '<progress>',
   'return_report': True,
   'rules': [],
   'strict': True,
   'target': 'ort-cpu',
   'verify': 'cpu',
   'verify_options': {'inputs': None,
                      'int_ranges': {'ids': [0, 3]},
                      'seed': 3,
                      'rtol': 0.1,
                      'atol': 0.2,
                      'runs': 4,
                      'warmup': 2,
                      'threads': 3,
                      'budget_s': 2.5,
                      'progress': '<progress>',
                      'provider_options': {'cpu': {'a': '1'}},
                      'bisect_options': ['--rules', 'r.py', '--disable', 'a', '--disable', 'b', '--fix-input-shape',
                                         'x=1x3x4x4', '--target', 'ort-cpu', '--max-rewrites', '5',
                                         '--fold-size-limit', '7', '--no-builtin-rules', '--exact']}}],
 [['m.onnx', '-o', 'o.onnx', '--external-data', 'w.bin', '--builtin-rules', '--no-exact', '--no-strict',
   '--no-quiet'],
  {'disable': [],
   'exact': False,
   'external_data': 'w.bin',
   'genai': None,
   'extra_rules': [],
   'fold_size_limit': 1048576,
   'input_layout': [],
   'input_preprocess': [],
   'input_shapes': {},
   'max_rewrites': None,
   'output': 'o.onnx',
   'output_layout': [],
   'outputs': '<outputs>',
   'precision': 'fp32',
   'padding': 'any',
   'progress': '<progress>',
   'return_report': True,
   'rules': None,
   'strict': False,
   'target': None}],
 [['m.onnx', '-o', 'o.onnx', '--external-data'],
  {'disable': [],
   'exact': False,
   'external_data': True,
   'genai': None,
   'extra_rules': [],
   'fold_size_limit': 1048576,
   'input_layout': [],
   'input_preprocess': [],
   'input_shapes': {},
   'max_rewrites': None,
   'output': 'o.onnx',
   'output_layout': [],
   'outputs': '<outputs>',
   'precision': 'fp32',
   'padding': 'any',
   'progress': '<progress>',
   'return_report': True,
   'rules': None,
   'strict': None,
   'target': None}],
 [['m.onnx', '-o', 'o.onnx', '--precision', 'fp16', '--target', 'cuda', '--input-shape', 'x=batch,3,4,4'],
  {'disable': [],
   'exact': False,
   'external_data': None,
   'genai': None,
   'extra_rules': [],
   'fold_size_limit': 1048576,
   'input_layout': [],
   'input_preprocess': [],
   'input_shapes': {'x': ['batch', 3, 4, 4]},
   'max_rewrites': None,
   'output': 'o.onnx',
   'output_layout': [],
   'outputs': '<outputs>',
   'precision': 'fp16',
   'padding': 'any',
   'progress': '<progress>',
   'return_report': True,
   'rules': None,
   'strict': None,
   'target': 'cuda'}],
 [['m.onnx', '-o', 'o.onnx'],
  {'disable': [],
   'exact': False,
   'external_data': None,
   'genai': None,
   'extra_rules': [],
   'fold_size_limit': 1048576,
   'input_layout': [],
   'input_preprocess': [],
   'input_shapes': {},
   'max_rewrites': None,
   'output': 'o.onnx',
   'output_layout': [],
   'outputs': '<outputs>',
   'precision': 'fp32',
   'padding': 'any',
   'progress': '<progress>',
   'return_report': True,
   'rules': None,
   'strict': None,
   'target': None}],
 [['quantize', 'm.onnx', '-o', 'q.onnx', '--calib', 'calib', '--method', 'percentile', '--per-tensor', '--target',
   'portable', '--exclude', 'Conv', 'n1', '--fidelity', '30', '--keep-float', 'never', '--threads', '2',
   '--latency-budget', '3', '--reduce-range', '--workers', '2', '--held-out', '4', '--percentile', '99.9',
   '--input-shape', 'x=1x3x4x4', '--strict', '-q'],
  {'calibration': 'calib',
   'exclude': ['Conv', 'n1'],
   'fidelity': 30.0,
   'held_out': 4,
   'input_shapes': {'x': [1, 3, 4, 4]},
   'keep_float': 'never',
   'latency_budget': 3.0,
   'method': 'percentile',
   'method_options': {'percentile': 99.9},
   'output': 'q.onnx',
   'outputs': '<outputs>',
   'per_channel': False,
   'progress': '<progress>',
   'reduce_range': True,
   'return_report': True,
   'strict': True,
   'target': 'portable',
   'threads': 2,
   'workers': 2}],
 [['quantize', 'm.onnx', '-o', 'q.onnx', '--calib', 'calib', '--per-channel', '--no-fidelity', '--no-quiet'],
  {'calibration': 'calib',
   'exclude': [],
   'fidelity': None,
   'held_out': None,
   'input_shapes': {},
   'keep_float': 'auto',
   'latency_budget': 10.0,
   'method': 'minmax',
   'method_options': {},
   'output': 'q.onnx',
   'outputs': '<outputs>',
   'per_channel': True,
   'progress': '<progress>',
   'reduce_range': None,
   'return_report': True,
   'strict': None,
   'target': 'ort-cpu',
   'threads': 1,
   'workers': 1}],
 [['quantize', 'm.onnx', '-o', 'q.onnx', '--calib', 'calib'],
  {'calibration': 'calib',
   'exclude': [],
   'fidelity': 20.0,
   'held_out': None,
   'input_shapes': {},
   'keep_float': 'auto',
   'latency_budget': 10.0,
   'method': 'minmax',
   'method_options': {},
   'output': 'q.onnx',
   'outputs': '<outputs>',
   'per_channel': True,
   'progress': '<progress>',
   'reduce_range': None,
   'return_report': True,
   'strict': None,
   'target': 'ort-cpu',
   'threads': 1,
   'workers': 1}]]

OPTIMIZE_DEFAULTS = {'rules': None,
 'extra_rules': (),
 'disable': (),
 'target': None,
 'output': None,
 'external_data': None,
 'genai': None,
 'max_rewrites': None,
 'fold_size_limit': 1048576,
 'fold_input_limit': 268435456,
 'graph_passes': None,
 'check': True,
 'inplace': False,
 'return_report': False,
 'stop_after': None,
 'verify': False,
 'verify_options': None,
 'outputs': None,
 'strict': None,
 'input_shapes': None,
 'exact': False,
 'progress': None,
 'quantize': None,
 'precision': 'fp32',
 'input_layout': None,
 'output_layout': None,
 'input_preprocess': None,
 'diff': None}

QUANTIZE_DEFAULTS = {'output': None,
 'method': 'minmax',
 'per_channel': True,
 'target': None,
 'exclude': (),
 'fidelity': 20.0,
 'keep_float': 'auto',
 'reduce_range': None,
 'workers': 1,
 'held_out': None,
 'input_shapes': None,
 'external_data': None,
 'check': True,
 'return_report': False,
 'outputs': None,
 'strict': None,
 'progress': None,
 'method_options': None,
 'threads': 1,
 'latency_budget': 10.0}


def _json(value):
    return json.loads(json.dumps(value, default=str))


# --------------------------------------------------------------------------------------------
# The keywords


def test_every_optimize_keyword_is_a_shortcut_with_its_default():
    known = {"output", *OptimizeOptions.keywords()}
    assert set(OPTIMIZE_KEYWORDS) <= known, set(OPTIMIZE_KEYWORDS) - known
    assert set(OPTIMIZE_KEYWORDS) == set(OPTIMIZE_DEFAULTS)
    now = OptimizeOptions().shortcuts()
    for name, default in OPTIMIZE_DEFAULTS.items():
        if name != "output":
            assert now[name] == default, name


def test_every_quantize_keyword_is_a_shortcut_with_its_default():
    known = {"output", *QuantizeOptions.keywords()}
    assert set(QUANTIZE_KEYWORDS) <= known, set(QUANTIZE_KEYWORDS) - known
    now = QuantizeOptions().shortcuts()
    for name, default in QUANTIZE_DEFAULTS.items():
        if name != "output":
            assert now[name] == default, name


@pytest.mark.parametrize("name", [k for k in OPTIMIZE_KEYWORDS if k != "output"])
def test_each_optimize_keyword_sets_its_field(name):
    marker = object()
    opts = OptimizeOptions().with_shortcuts(**{name: marker})
    if name == "verify_options":
        assert opts.verify.settings is marker
    else:
        assert opts.shortcuts()[name] is marker
        others = {k: v for k, v in opts.shortcuts().items() if k not in (name, "verify_options")}
        assert all(v is not marker for v in others.values())


@pytest.mark.parametrize("name", [k for k in QUANTIZE_KEYWORDS if k != "output"])
def test_each_quantize_keyword_sets_its_field(name):
    marker = object()
    assert QuantizeOptions().with_shortcuts(**{name: marker}).shortcuts()[name] is marker


def test_unknown_keywords_are_a_type_error_as_before():
    with pytest.raises(TypeError, match="optimize\\(\\) got an unexpected keyword argument 'targte'"):
        optimize(b"", targte="ort-cpu")
    with pytest.raises(TypeError, match="quantize\\(\\) got an unexpected keyword argument 'methd'"):
        quantize(b"", "calib", methd="mse")


def test_options_are_frozen_and_validated_with_one_line():
    opts = OptimizeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.target.target = "ort-cuda"  # type: ignore[misc]
    with pytest.raises(UsageError, match=r"^precision 'fp8': choose fp32 or fp16$"):
        optimize(_relu_model(), precision="fp8")
    with pytest.raises(UsageError, match=r"^precision 'fp8': choose fp32 or fp16$"):
        optimize(_relu_model(), options=OptimizeOptions(target=TargetOptions(precision="fp8")))
    with pytest.raises(UsageError, match="unknown layout 'NHWQ'"):
        optimize(_relu_model(), options=OptimizeOptions(layout=LayoutOptions(input_layout={"x": "NHWQ"})))


def _relu_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 4, 4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3, 1, 1], np.eye(3, dtype=np.float32).ravel().tolist())
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Identity", ["r"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])


def test_options_and_shortcuts_make_the_same_model():
    """The keywords and the objects are one setting: the same bytes and the same report; a
    keyword given with ``options`` wins over it."""
    model = _relu_model()
    by_keywords, r1 = optimize(model, target="ort-cpu", exact=True, input_shapes={"x": [1, 3, 4, 4]},
                               disable=["identity_elimination"], return_report=True)
    opts = OptimizeOptions(target=TargetOptions(target="ort-cpu"),
                           rewrite=RewriteOptions(exact=True, disable=["identity_elimination"]),
                           layout=LayoutOptions(input_shapes={"x": [1, 3, 4, 4]}))
    by_options, r2 = optimize(model, options=opts, return_report=True)
    assert by_keywords.SerializeToString() == by_options.SerializeToString()
    assert r1.settings == r2.settings and r1.after == r2.after and "Identity" in r1.after
    overridden, r3 = optimize(model, options=opts, disable=(), return_report=True)
    assert "Identity" not in r3.after and r3.settings == r1.settings


def test_verify_options_keyword_and_fields_meet():
    """``verify_options=`` (any verifier keyword) and the fields the flags set give one dict; the
    keyword wins; none of either: None, as the keyword's default was."""
    assert VerifyOptions().verifier_kwargs() is None
    v = VerifyOptions(rtol=0.5, runs=3, latency_budget=2.0, settings={"rtol": 0.25, "feeds": "F"})
    assert v.verifier_kwargs() == {"rtol": 0.25, "runs": 3, "budget_s": 2.0, "feeds": "F"}


# --------------------------------------------------------------------------------------------
# The flags and the config keys


def _parsers() -> dict:
    return {"optimize": CLI_OPTIMIZE.parser, "verify": cli.verify.parser, "bisect": cli.bisect.parser,
            "quantize": cli.quantize.parser, "diff": cli.diff.parser, "inspect": cli.inspect.parser}


@pytest.mark.parametrize("command", list(FLAGS))
def test_every_flag_of_every_subcommand_is_kept(command):
    parser = _parsers()[command]()
    assert sorted(o for a in parser._actions for o in a.option_strings) == FLAGS[command]


@pytest.mark.parametrize("command", list(PARSED))
def test_each_command_line_parses_as_it_did(command):
    """The same words give the same settings (every flag, by destination and value)."""
    for argv, expected in PARSED[command]:
        assert _json(vars(_parsers()[command]().parse_args(argv))) == expected, argv


def test_every_config_key_is_kept():
    assert [[k.name, k.kind, k.flag, {c: list(d) for c, d in k.dests.items()}] for k in config.SCHEMA] == CONFIG_KEYS


@pytest.fixture
def calls(monkeypatch) -> list:
    """What the command line passes to optimize() and quantize(), as the keywords they stand for."""
    seen: list = []

    class Stop(Exception):
        pass

    def record(calibration_at):
        def spy(*args, options=None, **kwargs):
            kwargs = {**(options.shortcuts() if options is not None else {}), **kwargs}
            if len(args) > calibration_at + 1:
                kwargs["output"] = args[calibration_at + 1]
            if calibration_at:
                kwargs["calibration"] = str(args[1])
            for k in ("outputs", "progress"):
                kwargs[k] = f"<{k}>" if kwargs.get(k) is not None else None
            if kwargs.get("extra_rules"):
                kwargs["extra_rules"] = [r.name for r in kwargs["extra_rules"]]
            seen.append(kwargs)
            raise Stop()
        return spy

    monkeypatch.setattr(CLI_OPTIMIZE, "optimize", record(0))
    monkeypatch.setattr(quantize_api, "quantize", record(1))
    return seen


def _same_call(kwargs: dict, defaults: dict) -> dict:
    """A call's keywords with the defaults filled in (a default given or left out is the same
    call), and the verifier's settings without those left at None."""
    call = _json({**defaults, **kwargs})
    if call.get("verify_options"):
        call["verify_options"] = {k: ("<progress>" if k == "progress" else v)
                                  for k, v in call["verify_options"].items() if v is not None}
    return call


def test_each_command_line_makes_the_call_it_made(calls, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])])), "m.onnx")
    (tmp_path / "r.py").write_text("from onnxopt import Op, Rule\nRULES = [Rule('mine', Op('Relu', 'x'), lambda m, b: "
                                   "m['x'])]\n")
    (tmp_path / "calib").mkdir()
    for argv, expected in CALLS:
        calls.clear()
        assert cli.main(argv) == 3 and len(calls) == 1, (argv, capsys.readouterr().err)  # (the spy stops it: 3)
        defaults = QUANTIZE_DEFAULTS if argv[0] == "quantize" else OPTIMIZE_DEFAULTS
        assert _same_call(calls[0], defaults) == _same_call(expected, defaults), argv


# --------------------------------------------------------------------------------------------
# A new option is written once


@pytest.fixture
def throwaway(monkeypatch):
    """A new rewrite option, declared as any option is: one field with its Option."""
    extended = dataclasses.make_dataclass(
        "RewriteOptions", [("max_fanout", "int | None", option(
            None, flags=("--max-fanout",), commands=("optimize", "bisect"), group="rules",
            argparse={"type": int, "metavar": "N"}, help="leave nodes with more consumers alone",
            key="max_fanout", kind="integer", about="the most consumers of a rewritten node", minimum=1))],
        bases=(RewriteOptions,), frozen=True)
    monkeypatch.setitem(options._CONCERNS, "rewrite", extended)
    monkeypatch.setattr(options, "ALL_CLASSES", (*options.ALL_CLASSES, extended))
    importlib.reload(config)  # (SCHEMA is derived when the module loads)
    yield extended
    monkeypatch.undo()
    importlib.reload(config)


def test_a_new_option_is_a_flag_a_config_key_and_a_keyword(throwaway, tmp_path):
    # a flag of the commands it names, in its group, with its help
    argv = ["m.onnx", "-o", "o.onnx", "--max-fanout", "4"]
    args = CLI_OPTIMIZE.parser().parse_args(argv)
    assert args.max_fanout == 4
    assert "--max-fanout N" in CLI_OPTIMIZE.parser().format_help()
    assert "--max-fanout" in cli.bisect.parser().format_help()
    assert "--max-fanout" not in cli.verify.parser().format_help()
    assert OptimizeOptions.from_args(args).rewrite.max_fanout == 4
    # a config key, checked like the others, that the flag overrides
    assert "max_fanout" in config.KEYS and config.KEYS["max_fanout"].dests == {"optimize": ("max_fanout",)}
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_fanout = 7\n")
    argv = ["m.onnx", "-o", "o.onnx", "-c", str(cfg)]
    assert config.merge(CLI_OPTIMIZE.parser().parse_args(argv), argv, CLI_OPTIMIZE.parser).max_fanout == 7
    assert config.merge(CLI_OPTIMIZE.parser().parse_args(argv + ["--max-fanout", "2"]), argv + ["--max-fanout", "2"],
                        CLI_OPTIMIZE.parser).max_fanout == 2
    cfg.write_text("max_fanout = 0\n")
    with pytest.raises(UsageError, match="max_fanout: 0 is below 1"):
        config.load(cfg)
    assert "| `max_fanout` | an integer | `--max-fanout` |" in config.markdown_table()
    # an optimize() keyword
    assert OptimizeOptions.keywords()["max_fanout"] == ("rewrite", "max_fanout")
    assert OptimizeOptions().with_shortcuts(max_fanout=3).rewrite.max_fanout == 3


# --------------------------------------------------------------------------------------------
# The stages: optimize()'s flow is a list


def test_the_flow_is_a_list_of_stages_and_a_stage_is_one_entry(monkeypatch):
    from onnxopt import api

    assert [s.__name__ for s in api.STAGES] == ["_load", "_measure_input", "_edges", "_plan_output", "_rewrite",
                                                "_precision", "_measure", "_verify", "_save"]
    model = _relu_model()
    plain, report = optimize(model, target="ort-cpu", return_report=True, input_shapes={"x": [1, 3, 4, 4]})
    assert set(report.seconds) == {"load", "rewrite", "save", "total"}

    seen = []

    def count_convs(run):  # a new stage: reads the options and what the stages before it left
        seen.append((run.options.target.target, run.after.get("Conv"), run.before.get("Conv")))

    at = api.STAGES.index(api._measure) + 1
    monkeypatch.setattr(api, "STAGES", (*api.STAGES[:at], count_convs, *api.STAGES[at:]))
    again, report2 = optimize(model, target="ort-cpu", return_report=True, input_shapes={"x": [1, 3, 4, 4]})
    assert seen == [("ort-cpu", 1, 1)]
    assert again.SerializeToString() == plain.SerializeToString() and report2.after == report.after
