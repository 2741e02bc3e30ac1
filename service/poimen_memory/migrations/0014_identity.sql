-- Support of derived memories (issue 24): how many parents a node was written with, so a
-- result can say that some of its evidence is gone. Edges cascade when a parent is deleted,
-- so the edges alone cannot tell "derived from nothing" from "its evidence vanished": the
-- count is kept on the node, set by the writer (memory._write_nodes: the distinct parents the
-- node names, raised when a later write links more) and never lowered by a delete.
-- memory.support_status compares it with the parents still there (full, partial, none).
--
-- A constant default is a catalog-only change (no rewrite). Nodes written before this
-- migration get the parents they have now: what was deleted before it is not known.
ALTER TABLE memory.nodes
    ADD COLUMN parents_declared integer NOT NULL DEFAULT 0
        CONSTRAINT nodes_parents_declared_check CHECK (parents_declared >= 0);

UPDATE memory.nodes n SET parents_declared = e.cnt
FROM (SELECT child_id, project_id, count(*)::integer AS cnt
      FROM memory.edges GROUP BY child_id, project_id) e
WHERE n.id = e.child_id AND n.project_id = e.project_id;
