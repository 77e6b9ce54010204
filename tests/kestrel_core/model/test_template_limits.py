"""Chat templates are programs from model files: each render is bounded in steps, time, sizes and output.

The cases that would kill the process without the limits (``'a' * 300000000`` aborts it, exit status 134) run in
a subprocess under RLIMIT_AS, so a broken limit fails the test instead of the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model import chat_template
from kestrel_core.model.tokenizer import Tokenizer

from ..waits import HANG_GUARD_S, within

HOSTILE = {
    "string repetition": "{{ 'a' * 300000000 }}",
    "list repetition": "{{ [1, 2] * 100000000 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling concat": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling +": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                  "{% endfor %}{{ ns.s|length }}",
    "huge power": "{{ 2 ** 1000000000 }}",
    "squaring ints": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                     "{% endfor %}{{ ns.n > 0 }}",
    "center filter": "{{ 'a'|center(1000000000) }}",
    "str method": "{{ 'a'.ljust(1000000000) }}",
    "format width": "{{ '{:>999999999}'.format('a') }}",
    "format width argument": "{{ '{:>{}}'.format('a', 999999999) }}",
    "format width as text": "{{ '{0:{1}}'.format('a', '999999999') }}",
    "percent width": "{{ '%999999999s' % 'a' }}",
    "replace blowup": "{{ ('a' * 1000000)|replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}",
    "join blowup": "{{ ((range(100000)|list) * 100)|join('x' * 1000) }}",
    "binary macro recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                              "{{ f(60) }}",
    "endless macro recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "output flood": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxxxxx"
                    "{% endfor %}{% endfor %}",
    "recursive loop": "{% for x in range(100) recursive %}{{ loop(range(100)) }}{% endfor %}",
    "tojson indent": "{{ messages|tojson(indent=100000000) }}",
    # a value within the limits that prints as terabytes: four million references to one 4 MB string
    "tojson of shared items": "{{ (['x' * 4000000] * 4000000)|tojson }}",
    "string of shared items": "{{ (['x' * 4000000] * 100)|string }}",
    "pprint of shared items": "{{ (['x' * 4000000] * 100)|pprint }}",
    "printed shared items": "{{ ['x' * 4000000] * 100 }}",
    "percent of shared items": "{{ '%s' % (['x' * 4000000] * 100) }}",
    "concat of shared items": "{{ 'a' ~ (['x' * 4000000] * 100) }}",
    "join of shared items": "{{ [['x' * 4000000] * 100]|join(',') }}",
    "format of shared items": "{{ '{}'.format(['x' * 4000000] * 100) }}",
}


def tok(template: str) -> Tokenizer:
    return Tokenizer(Backend(models.BPE()), chat_template=template, bos_token="<s>", eos_token="</s>")


def render(template: str) -> str:
    return tok(template).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.fixture
def fast_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_STEPS", 100_000)
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_SECONDS", 2.0)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_end_in_one_line(name: str, fast_limits: None) -> None:
    with pytest.raises(KestrelError) as info:
        within(HANG_GUARD_S, lambda: render(HOSTILE[name]))
    msg = str(info.value)
    assert msg.startswith("chat template ") and "\n" not in msg


# each builds twice the 10k characters of ``small_limits`` (or copies them, for sum) and prints only its length
OVER_SMALL_LIMITS = {
    "set block": "{% set s = 'x' * 6000 %}{% set big %}{{ s }}{{ s }}{% endset %}{{ big|length }}",
    "filter block": "{% set s = 'x' * 6000 %}{% filter truncate(9) %}{{ s }}{{ s }}{% endfilter %}",
    "macro body": "{% set s = 'x' * 6000 %}{% macro m() %}{{ s }}{{ s }}{% endmacro %}{{ m()|length }}",
    "caller": "{% set s = 'x' * 6000 %}{% macro m() %}{{ caller()|length }}{% endmacro %}"
              "{% call m() %}{{ s }}{{ s }}{% endcall %}",
    "expandtabs": "{{ ('\\t' * 100).expandtabs(200)|length }}",
    "translate": "{{ ('a' * 100).translate({97: 'b' * 200})|length }}",
    "format widths": "{{ ('{0:5000}' * 4).format('x')|length }}",
    "percent widths": "{{ (('%(a)5000s' * 4) % {'a': 'x'})|length }}",
    "format filter widths": "{{ ('%(a)5000s' * 4)|format(a='x')|length }}",
    "tojson separators": "{{ range(100)|list|tojson(separators=('x' * 200, ':'))|length }}",
    "lipsum": "{{ lipsum(100, false)|length }}",
    "sum of lists": "{{ ([[1, 2, 3, 4]] * 100)|sum(start=[])|length }}",
}


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_CHARS", 10_000)


@pytest.mark.parametrize("name", list(OVER_SMALL_LIMITS))
def test_values_over_the_size_limit_are_refused_before_they_are_built(name: str, small_limits: None) -> None:
    with pytest.raises(KestrelError) as info:
        render(OVER_SMALL_LIMITS[name])
    msg = str(info.value)
    assert msg.startswith("chat template stopped: ") and "10000" in msg and "\n" not in msg
    assert "a value of" not in msg  # the measure of a value already built (_check_size), not a check before


def test_the_sized_helpers_still_work_within_the_limits(small_limits: None) -> None:
    t = ("{% set s %}ab{% endset %}{{ s }}|{% filter upper %}cd{% endfilter %}|{{ 'a\\tb'.expandtabs(4) }}|"
         "{{ 'ab'.translate({97: 'xy'}) }}|{{ '{0:3}'.format('x') }}|{{ '%(a)3s' % {'a': 'x'} }}|"
         "{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ [[1], [2]]|sum(start=[]) }}|{{ lipsum(1)|length > 0 }}")
    assert render(t) == "ab|CD|a   b|xyb|x  |  x|[1,2]|[1, 2]|True"


def test_the_deadline_stops_slow_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_STEPS", 10 ** 12)  # only the clock can stop it
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_SECONDS", 0.2)
    with pytest.raises(KestrelError, match="took more than 0.2 s"):
        within(HANG_GUARD_S, lambda: render(HOSTILE["nested ranges"]))


def test_output_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_CHARS", 10_000)
    with pytest.raises(KestrelError, match="rendered prompt passed 10000"):
        render("{% for i in range(100000) %}{{ m }}abcdefghij{% endfor %}")


def test_ordinary_templates_still_render() -> None:
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert render(chatml) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    t = ("{% for x in range(3) %}{{ loop.index }}/{{ loop.length }}{{ 'a' ~ x }}{% if not loop.last %},"
         "{% endif %}{% endfor %}|{{ 'ab' * 3 }}|{{ '%5s' % 'x' }}|{{ '{:>4}'.format(7) }}|{{ 2 ** 10 }}|"
         "{{ messages|tojson }}|{{ 'a b'|replace(' ', '-') }}|{{ ['x', 'y']|join(', ') }}|{{ 'x'|center(5) }}")
    assert render(t) == ('1/3a0,2/3a1,3/3a2|ababab|    x|   7|1024|[{"role": "user", "content": "hi"}]|a-b|x, y|'
                         "  x  ")
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert render(ns) == "1"


def test_limits_are_per_render(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_STEPS", 5_000)
    t = tok("{% for i in range(1000) %}{{ i }}{% endfor %}")
    for _ in range(20):  # 20 x 1000 steps in all, 1000 per render
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_cannot_rebind_the_guards(fast_limits: None) -> None:
    t = ("{% set kestrel_iter = none %}{% set _guard_iter = none %}"
         "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(KestrelError, match="more than"):
        render(t)


BOUNDED = textwrap.dedent("""
    import resource, sys
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    from tokenizers import Tokenizer as Backend, models
    from kestrel_core.errors import KestrelError
    from kestrel_core.model.tokenizer import Tokenizer
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30),) * 2)
    for template in sys.argv[1:]:
        try:
            tok = Tokenizer(Backend(models.BPE()), chat_template=template)
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
            print("rendered", flush=True)
        except KestrelError as exc:
            print("KestrelError:", " ".join(str(exc).split()), flush=True)
""")


def test_allocation_bombs_stay_under_the_memory_limit() -> None:
    """In a subprocess with 1 GiB of address space to spare: the template bombs end in KestrelErrors that are not
    memory errors (without the limits the doubling concat needs 1 TB, ``[1, 2] * 10**8`` 1.6 GB)."""
    names = ["string repetition", "list repetition", "doubling concat", "doubling +", "center filter",
             "format width", "format width as text", "percent width", "replace blowup", "join blowup", "str method",
             *(name for name in HOSTILE if name.endswith("shared items"))]
    root = str(Path(kestrel_core.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", BOUNDED, *(HOSTILE[n] for n in names)], capture_output=True,
                       text=True, timeout=HANG_GUARD_S, env=env)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(names), r.stdout + r.stderr[-2000:]
    for name, line in zip(names, lines):
        assert line.startswith("KestrelError: chat template stopped") and "MemoryError" not in line, (name, line)
