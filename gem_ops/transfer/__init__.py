"""Knowledge transfer from a foundation model to the smaller models that serve.

Direct: GEM -> vertical model. Hierarchical: GEM -> domain foundation model -> vertical model. A teacher
reaches a student through three mechanisms, each optional:
  - distillation: the teacher's logits, mapped by a Student Adapter trained on fresh labels, train an
    auxiliary head on the student's trunk (knowledge.py, adapter.py);
  - representation transfer: the teacher's candidate-independent representation of the request's (domain,
    user, day), looked up in a table the teacher computed once a day, is one more student input token
    (user_representations.py);
  - parameter sharing: the student starts from (and may freeze) the teacher's embedding tables, read at
    its own width through a learnt projection (sharing.py).
"""
