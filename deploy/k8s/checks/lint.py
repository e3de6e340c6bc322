"""yamllint (deploy/k8s/.yamllint) over the values files and the rendered manifests."""

from __future__ import annotations

from yamllint import linter
from yamllint.config import YamlLintConfig

from .settings import YAMLLINT_CONFIG


def lint_yaml(documents: dict[str, str]) -> list[str]:
    """yamllint on name -> text; warnings count as failures."""
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    problems = []
    for name, text in documents.items():
        for problem in linter.run(text, config):
            problems.append(
                f"{name}:{problem.line}:{problem.column}: [{problem.level}] {problem.desc} ({problem.rule})"
            )
    return problems
