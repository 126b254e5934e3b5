"""Quality of replayed answers: ``grading.py`` (FastChat single-answer grading with cached, retrying backends),
``answers.py`` (a run's answers graded, and the judge-free log-likelihood proxy), ``proxies.py`` (agreement with a
baseline's tokens, the mean log-likelihood)."""
