"""`nano.cli`: the `nano` command line (installed from this `cli/` folder as the subpackage `nano.cli`).

    main.py      the Typer app and the entry point; registers one function from each command module
    models.py    nano models [--capacity]       capacity.py   the 8×H200 capacity arithmetic (a fit)
    chat.py      nano chat
    bench.py     nano bench                     loadgen.py    workload, driver, figures   blog.py  --reproduce-blog
                                                progress.py   a long command's plan, phase k/n and ETA
    profile.py   nano profile
    fault.py     nano fault                     faults.py     the fault injectors and trials (tests use them too)
    eval.py      nano eval                      (the method is nano/evaluate.py)
    options.py   the engine flags, declared once (@engine_flags) and built into an LLM or SplitLLM
    console.py   out/err consoles, the `error:` helpers, number formats
    machine.py   versions, device names, copy timing

Imports point down: main -> command modules -> (blog -> loadgen), options, console, machine. No command module
imports main, and nothing imports a command module but main (and bench, which imports blog).
"""
