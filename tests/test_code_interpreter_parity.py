"""Parity of the `code-interpreter` template with E2B's, through the unchanged
e2b-code-interpreter SDK (issue 21): languages, the data stack and its rich results
(data, charts, images), env vars in every language, E2B's result text, root kernels
in /home/user with a cwd per context, and a server and kernels that come back when
killed. One sandbox serves every case.
"""

from __future__ import annotations

import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import ChartType

from agentenv.testing import Node

pytestmark = pytest.mark.needs_build("code-interpreter")

CREATE_ENVS = {"FROM_CREATE": "visible", "SHARED": "sandbox's"}
# (language, code printing FROM_CREATE, PER_RUN and SHARED, separated by spaces)
ENV_PROBES = [
    ("python", "import os\nprint(*(os.environ.get(k, '-') for k in "
               "('FROM_CREATE', 'PER_RUN', 'SHARED')))"),
    ("js", "console.log(['FROM_CREATE', 'PER_RUN', 'SHARED']"
           ".map(k => process.env[k] ?? '-').join(' '))"),
    ("ts", "console.log(['FROM_CREATE', 'PER_RUN', 'SHARED']"
           ".map((k: string) => process.env[k] ?? '-').join(' '))"),
    ("bash", 'echo "${FROM_CREATE:--} ${PER_RUN:--} ${SHARED:--}"'),
    ("r", "cat(sapply(c('FROM_CREATE', 'PER_RUN', 'SHARED'), function(k) "
          "Sys.getenv(k, '-')), '\\n')"),
]


@pytest.fixture(scope="module")
def sbx(node: Node):
    sandbox = Sandbox.create(timeout=300, envs=CREATE_ENVS)
    yield sandbox
    sandbox.kill()


def _stdout(sbx: Sandbox, code: str, **kw) -> str:
    execution = sbx.run_code(code, timeout=60, **kw)
    assert execution.error is None, execution.error
    return "".join(execution.logs.stdout).strip()


def test_default_contexts_and_languages(sbx: Sandbox) -> None:
    """Python and JavaScript contexts start with the sandbox, as on E2B; each
    language runs in its own kernel and keeps its state."""
    languages = [c.language for c in sbx.list_code_contexts()]
    assert "python" in languages and "javascript" in languages
    assert _stdout(sbx, "const xs = [1, 2, 3]; console.log(xs.map(x => x * 2).join(','))",
                   language="javascript") == "2,4,6"
    assert _stdout(sbx, "console.log(xs.length)", language="js") == "3"
    assert _stdout(sbx, "const n: number = 21; console.log(n * 2)", language="typescript") == "42"
    assert _stdout(sbx, "x=5; echo $((x * 3))", language="bash") == "15"
    assert _stdout(sbx, "echo $x", language="bash") == "5"
    r = sbx.run_code("v <- c(1, 2, 3)\nsum(v) * 2", language="r", timeout=60)
    # IRkernel shows values as display data (as on E2B): a result, not the main one
    assert r.error is None and [x.text for x in r.results] == ["[1] 12"]
    err = sbx.run_code("cat(undefined_thing)", language="r", timeout=60).error
    assert err is not None and "undefined_thing" in err.value
    # a JavaScript context of one's own, with its cwd
    ctx = sbx.create_code_context(language="javascript", cwd="/tmp")
    assert ctx.language == "javascript"
    assert _stdout(sbx, "console.log(process.cwd())", context=ctx) == "/tmp"
    sbx.remove_code_context(ctx)


def _has_java(sbx: Sandbox) -> bool:
    return sbx.commands.run("test -e /opt/aenv-ci/share/jupyter/kernels/java/kernel.json "
                            "&& echo yes || echo no").stdout.strip() == "yes"


def test_java_as_e2b(sbx: Sandbox) -> None:
    """Java (JJava on Debian's JDK): E2B's test_java_kernel, test_cwd_java and
    env_vars/test_java. A template built without it (AENV_CI_JAVA=0) says so."""
    if not _has_java(sbx):
        with pytest.raises(Exception) as failed:
            sbx.run_code('System.out.println("hi");', language="java")
        assert "not supported" in str(failed.value) and "AENV_CI_JAVA=0" in str(failed.value)
        pytest.skip("this code-interpreter template was built without Java (AENV_CI_JAVA=0)")
    execution = sbx.run_code('System.out.println("Hello, World!")', language="java",
                             timeout=120)
    assert execution.error is None, execution.error
    assert execution.logs.stdout[0] == "Hello, World!"  # E2B's IJava splits the line end
    assert "".join(execution.logs.stdout) == "Hello, World!\n"
    assert sbx.run_code('System.getProperty("user.dir")', language="java").text == "/home/user"
    assert sbx.run_code("int x = 20;", language="java").results == []
    assert sbx.run_code("x * 2 + 2", language="java").text == "42"  # state is kept
    probe = 'System.getProperty("FROM_CREATE") + " " + System.getProperty("PER_RUN", "-")'
    assert sbx.run_code(probe, language="java", envs={"PER_RUN": "it's \"q\""}).text == \
        'visible it\'s "q"'
    assert sbx.run_code(probe, language="java").text == "visible -"
    err = sbx.run_code('String s = null; s.length()', language="java").error
    assert err is not None and "NullPointerException" in err.value
    ctx = sbx.create_code_context(language="java", cwd="/tmp")
    assert sbx.run_code('System.getProperty("user.dir")', context=ctx).text == "/tmp"
    sbx.remove_code_context(ctx)


def test_languages_not_built_are_refused_clearly(sbx: Sandbox) -> None:
    with pytest.raises(Exception) as failed:
        sbx.run_code("1", language="cobol")
    assert "not supported" in str(failed.value)
    assert sbx.run_code("1 + 1").text == "2"  # the server serves on


@pytest.mark.parametrize("language,code", ENV_PROBES, ids=[p[0] for p in ENV_PROBES])
def test_env_vars_in_every_language(sbx: Sandbox, language: str, code: str) -> None:
    """The sandbox's env vars are in every kernel; a run's envs hold for that run
    only (a var the sandbox has comes back to its value, a new one goes)."""
    assert _stdout(sbx, code, language=language) == "visible - sandbox's"
    assert _stdout(sbx, code, language=language,
                   envs={"PER_RUN": "it's $set", "SHARED": "run's"}) == \
        "visible it's $set run's"
    assert _stdout(sbx, code, language=language) == "visible - sandbox's"


def test_javascript_and_typescript_results_as_e2b(sbx: Sandbox) -> None:
    """E2B's JavaScript kernel: the last expression's value is the run's result (not a
    line on stdout), top-level await included; a throw is the run's error; runs are
    counted (E2B's test_cwd_javascript, test_js_top_level_await, env_vars/test_js)."""
    for language in ("js", "ts"):
        execution = sbx.run_code("process.cwd()", language=language, timeout=60)
        assert execution.text == "/home/user" and execution.logs.stdout == []
        assert execution.results[0].is_main_result and execution.execution_count >= 1
    assert sbx.run_code("await Promise.resolve('Hello World!')", language="js").text == \
        "Hello World!"
    assert sbx.run_code("const ys = [1, 2]; ys.map(y => y * 2)", language="js").text == "[ 2, 4 ]"
    # the sandbox's env vars and a run's, as results
    code = "process.env.FROM_CREATE + ' ' + (process.env.PER_RUN || 'default')"
    assert sbx.run_code(code, language="js", envs={"PER_RUN": "bar"}).text == "visible bar"
    assert sbx.run_code(code, language="js").text == "visible default"
    # no result for a statement or an undefined value
    assert sbx.run_code("console.log('hi')", language="js").results == []
    err = sbx.run_code("throw new TypeError('boom')", language="js").error
    assert err is not None and (err.name, err.value) == ("TypeError", "boom")
    assert "boom" in err.traceback
    err = sbx.run_code("await Promise.reject(new RangeError('later'))", language="js").error
    assert err is not None and (err.name, err.value) == ("RangeError", "later")
    err = sbx.run_code("const n: number = 'x'", language="ts").error
    assert err is not None and err.name == "TSError" and "not assignable" in err.value
    # a failed run with env vars puts them back (tslab dropped the next run for 200 ms)
    assert sbx.run_code("throw new Error('x')", language="js",
                        envs={"PER_RUN": "leak"}).error is not None
    assert sbx.run_code(code, language="js").text == "visible default"


def test_env_var_names_are_checked(sbx: Sandbox) -> None:
    with pytest.raises(Exception) as failed:
        sbx.run_code("1", envs={"BAD NAME": "x"})
    assert "not valid" in str(failed.value)


def test_result_text_as_e2b(sbx: Sandbox) -> None:
    assert sbx.run_code("'hello'").results[0].text == "hello"
    assert sbx.run_code('"it\'s"').text == "it's"
    assert sbx.run_code("['a']").text == "['a']"


def test_kernels_run_as_root_in_home_user(sbx: Sandbox) -> None:
    assert sbx.run_code("import os, getpass\n(getpass.getuser(), os.getcwd())").text == \
        "('root', '/home/user')"
    assert _stdout(sbx, "whoami; pwd", language="bash") == "root\n/home/user"
    ctx = sbx.create_code_context(cwd="/root")
    assert ctx.cwd == "/root"
    assert sbx.run_code("import os\nopen('mine', 'w').write('x')\nos.getcwd()",
                        context=ctx).text == "/root"
    assert sbx.run_code("import os\nos.path.exists('/root/mine')").text == "True"
    sbx.remove_code_context(ctx)
    with pytest.raises(Exception) as failed:
        sbx.create_code_context(cwd="/no/such/dir")
    assert "not a directory" in str(failed.value)


def test_dataframes_and_charts(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import pandas as pd, matplotlib.pyplot as plt\n"
        "df = pd.DataFrame({'city': ['A', 'B'], 'people': [3, 5]})\n"
        "display(df)\n"
        "fig, ax = plt.subplots()\n"
        "ax.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
        "ax.set_title('Growth'); ax.set_xlabel('Time (s)'); ax.set_ylabel('Size [m]')\n"
        "plt.show()\n")
    assert execution.error is None, execution.error
    table, figure = execution.results
    assert table.data == {"city": ["A", "B"], "people": [3, 5]} and table.html
    assert figure.png and figure.png.startswith("iVBOR")  # a base64 PNG
    chart = figure.chart
    assert chart is not None and chart.type == ChartType.LINE and chart.title == "Growth"
    assert (chart.x_label, chart.x_unit, chart.y_unit) == ("Time (s)", "s", "m")
    assert chart.x_scale == "linear" and chart.x_ticks and chart.x_tick_labels
    assert chart.elements[0].label == "squares"
    assert chart.elements[0].points == [(1.0, 1.0), (2.0, 4.0), (3.0, 9.0)]


def test_supergraph_of_bar_pie_scatter_box(sbx: Sandbox) -> None:
    results = []
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "fig, axs = plt.subplots(2, 2)\nfig.suptitle('All')\n"
        "axs[0, 0].bar(['a', 'b'], [3, 1], label='sales')\n"
        "axs[0, 1].pie([1, 3], labels=['p', 'q'])\n"
        "axs[1, 0].scatter([1, 2], [3, 4], label='pts')\n"
        "axs[1, 1].boxplot([[1, 2, 3, 4, 5, 20]], patch_artist=True, tick_labels=['A'])\n"
        "plt.show()\n", on_result=results.append)
    assert execution.error is None, execution.error
    # display data reaches on_result as it is produced, not only at the end
    assert len(results) == 1 and not results[0].is_main_result and results[0].chart
    chart = execution.results[0].chart
    assert chart.type == ChartType.SUPERCHART and chart.title == "All"
    bar, pie, scatter, box = chart.elements
    assert bar.type == ChartType.BAR
    assert [(e.label, e.group, e.value) for e in bar.elements] == \
        [("a", "sales", 3.0), ("b", "sales", 1.0)]
    assert pie.type == ChartType.PIE
    assert [(e.label, e.angle) for e in pie.elements] == [("p", 90.0), ("q", 270.0)]
    assert scatter.type == ChartType.SCATTER
    assert scatter.elements[0].points == [(1.0, 3.0), (2.0, 4.0)]
    assert box.type == ChartType.BOX_AND_WHISKER
    b = box.elements[0]
    assert (b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers) == \
        ("A", 1.0, 2.25, 3.5, 4.75, 5.0, [20.0])


def test_pie_and_box_charts_as_e2b(sbx: Sandbox) -> None:
    """E2B's charts/test_pie.py and charts/test_box_and_whiskers.py: a 90/10 pie is 324
    and 36 degrees (not float residue), and boxplot(labels=...) works (matplotlib 3.10,
    E2B's pin; 3.11 removed it)."""
    pie = sbx.run_code(
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
        "ax.pie([90, 10], labels=['No', 'No, in blue'], autopct='%1.1f%%', startangle=90)\n"
        "plt.title('Will I?')\nplt.show()\n").results[0].chart
    assert pie.type == ChartType.PIE and pie.title == "Will I?"
    assert [(e.label, e.angle, e.radius) for e in pie.elements] == \
        [("No", 324, 1), ("No, in blue", 36, 1)]
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
        "ax.set_title('Scores'); ax.set_xlabel('Class'); ax.set_ylabel('Score')\n"
        "ax.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87]], labels=['A', 'B'],"
        " patch_artist=True)\nplt.show()\n")
    assert execution.error is None, execution.error
    box = execution.results[0].chart
    assert box.type == ChartType.BOX_AND_WHISKER and box.x_label == "Class"
    assert [(b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers)
            for b in box.elements] == [("A", 78, 85, 88, 90, 92, []),
                                       ("B", 84, 84.75, 88, 90.5, 95, [76])]


def test_pillow_images_show_as_results(sbx: Sandbox) -> None:
    execution = sbx.run_code("from PIL import Image\nImage.new('RGB', (8, 8), 'red').show()")
    assert execution.error is None and execution.results[0].png


def _server_pid(sbx: Sandbox) -> int:
    out = sbx.commands.run("pgrep -f '^/opt/aenv-ci/bin/python /opt/aenv-ci/server.py'").stdout
    pids = out.split()
    assert len(pids) == 1, out
    return int(pids[0])


def _run_when_back(sbx: Sandbox, code: str, wait: float = 60) -> str:
    deadline = time.monotonic() + wait
    while True:
        try:
            execution = sbx.run_code(code, timeout=30)
            assert execution.error is None, execution.error
            return str(execution.text)
        except (TimeoutException, Exception):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_killed_kernel_comes_back(sbx: Sandbox) -> None:
    sbx.run_code("state = 1")
    pid = int(sbx.run_code("import os\nos.getpid()").text)
    sbx.commands.run(f"kill -9 {pid}", user="root")
    # the very next run works, in a new kernel
    execution = sbx.run_code("import os\nos.getpid()")
    assert execution.error is None, execution.error
    assert int(execution.text) != pid
    assert sbx.run_code("'state' in globals()").text == "False"  # a new kernel


def test_a_killed_server_comes_back(sbx: Sandbox) -> None:
    server = _server_pid(sbx)
    kernel = int(sbx.run_code("import os\nos.getpid()").text)
    js_kernel = int(_stdout(sbx, "console.log(process.pid)", language="js"))
    sbx.commands.run(f"kill -9 {server}", user="root")
    new_kernel = int(_run_when_back(sbx, "import os\nos.getpid()"))
    assert _server_pid(sbx) != server and new_kernel != kernel
    # the old server's kernels went with it (none left to hold memory); the
    # default contexts are back
    deadline = time.monotonic() + 20
    while _alive(sbx, kernel) or _alive(sbx, js_kernel):
        assert time.monotonic() < deadline, "an old kernel outlived its server"
        time.sleep(0.5)
    assert int(_stdout(sbx, "console.log(process.pid)", language="js")) != js_kernel
    assert {"python", "javascript"} <= {c.language for c in sbx.list_code_contexts()}


def _alive(sbx: Sandbox, pid: int) -> bool:
    return sbx.commands.run(f"test -e /proc/{pid} && echo yes || echo no").stdout.strip() == "yes"
