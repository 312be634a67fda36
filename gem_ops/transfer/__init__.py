"""Knowledge transfer from a foundation model to the smaller models that serve.

Direct: GEM -> vertical model. Hierarchical: GEM -> domain foundation model -> vertical model. A teacher
reaches a student through three mechanisms, each optional:
  - distillation: the teacher's logits, mapped by a Student Adapter trained on fresh labels, train an
    auxiliary head on the student's trunk (knowledge.py, adapter.py);
  - representation transfer: the teacher's trunk representation is one more student input token;
  - parameter sharing: the student starts from (and may freeze) the teacher's embedding tables (sharing.py).
"""
