-- The query grammar (docs/sql-api.md, "Query grammar"): one parser, in PL/pgSQL so it runs
-- where PL/Python is missing, read by every leg (memory.lexical_search parses its own
-- query; the planner puts the parse in the plan for the semantic legs and OpenSearch).
--   "quoted phrase"   in a question (any plain word outside the operators): it helps, it
--                     does not filter (boost): its words are scored as plain words and the
--                     fused candidates that contain it rank first; people quote titles in
--                     questions, and a filter emptied 5 of LoCoMo dev's 11 quoted
--                     questions (docs/benchmarks.md, "Phrases that help")
--   +"quoted phrase"  required (strict): the words in this order, adjacent (stop words keep
--                     their slot); a phrase in a query made only of operators (no plain
--                     word) is strict too: there it is all the caller asked for
--   -word, -"phrase"  excluded: no result contains it (-#tag, -@mention too)
--   #tag, @mention    required: the exact token, unstemmed, case-insensitive
--   A OR B            between required items: either satisfies; between plain words the
--                     default (BM25 is disjunctive already); with a plain word or a soft
--                     phrase the item becomes optional
-- Plain words are scored as before. Malformed syntax never errors: an unmatched quote is
-- dropped (its words become plain words), an empty phrase, a lone "-" or a dangling OR are
-- ignored, and notes says so.

CREATE OR REPLACE FUNCTION memory._grammar_pattern(token text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- Word boundaries (\m, \M) around the token with its regex metacharacters escaped.
RETURN '\m' || replace(regexp_replace(token, '([.^$*+?()\[\]{}|\\-])', '\\\1', 'g'), ' ', '\s+') || '\M';
COMMENT ON FUNCTION memory._grammar_pattern(text) IS
    'The case-insensitive regular expression (for ~*) that finds token as a whole word (or words, any white space between them): its metacharacters escaped, word boundaries around it.';

CREATE OR REPLACE FUNCTION memory._grammar_item(kind text, value text)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- only when the words have lexemes: phraseto_tsquery would NOTICE about stop words
    tq tsquery := CASE WHEN kind IN ('phrase', 'term')
                            AND to_tsvector('english'::regconfig, value) <> ''::tsvector
                       THEN phraseto_tsquery('english'::regconfig, value) END;
BEGIN
    -- A phrase or term is matched on the node's tsvector (stemmed, with positions); one of
    -- stop words only, and a tag or mention, on its text (the exact token).
    RETURN jsonb_build_object('kind', kind, 'value', value)
        || CASE WHEN tq IS NOT NULL AND numnode(tq) > 0
                THEN jsonb_build_object('tsquery', tq::text)
                ELSE jsonb_build_object('pattern', memory._grammar_pattern(value)) END;
END $$;
COMMENT ON FUNCTION memory._grammar_item(text, text) IS
    'One operand of the query grammar: {"kind": phrase|term|tag|mention, "value", and how a node is tested: "tsquery" (phrase or term: phraseto_tsquery english over the node''s tsvector) or "pattern" (tag, mention, or words that are all stop words: a whole-word regex over its text)}.';

CREATE OR REPLACE FUNCTION memory.parse_query(query text)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    q text := coalesce(query, '');
    notes jsonb := '[]';
    tok record;
    scored text[] := '{}';
    routed text[] := '{}';
    groups jsonb := '[]';
    excl jsonb := '[]';
    boost jsonb := '[]';
    item jsonb;
    neg boolean;
    is_strict boolean;
    -- a token of the query: a sign (- excludes, + makes a phrase strict), then a quoted
    -- phrase or a run of other characters
    tokens constant text := '([-+]?)(?:"([^"]*)"|([^\s"]+))';
    -- whether the query holds a plain word (a token outside every operator with a letter
    -- or digit): without one, its phrases are strict
    has_words boolean;
    word text;
    w text;
    m text[];
    pending_or boolean := false;
    prev text;  -- what the previous operand was: required, word, excluded (NULL: none yet)
    n_or integer := 0;
    optional integer := 0;
BEGIN
    -- Bounded before it is read, as every entry point bounds a query (memory.check_query,
    -- which raises here): the parse below grows its arrays a token at a time, and a reader
    -- calling it (or memory.lexical_search) with 60 kB of "#t " held a backend 210 s.
    IF length(q) > @vocabulary.query_max_chars@ THEN
        PERFORM memory.check_query(q);
    END IF;
    -- The common case costs one regex test: no quote, sigil, leading "-" or OR, no operators.
    IF q !~ '["#@]|(^|\s)-|(^|\s)OR(\s|$)' THEN
        RETURN jsonb_build_object('operators', false, 'text', q, 'required', '[]'::jsonb,
                                  'exclude', '[]'::jsonb, 'boost', '[]'::jsonb, 'or', 0,
                                  'notes', '[]'::jsonb);
    END IF;
    IF (length(q) - length(replace(q, '"', ''))) % 2 = 1 THEN
        q := regexp_replace(q, '"([^"]*)$', ' \1');
        notes := notes || to_jsonb('an unmatched quote was dropped: its words are plain words'::text);
    END IF;
    SELECT coalesce(bool_or(r[2] IS NULL AND r[3] <> 'OR' AND r[3] ~ '[[:alnum:]]'
                            AND NOT (r[1] = '-' AND r[3] ~ '^[[:alpha:]]')
                            AND lower(r[3]) !~ '^[#@]\w'), false)
      INTO has_words
      FROM regexp_matches(q, tokens, 'g') AS r;
    FOR tok IN SELECT r[1] AS sign, r[2] AS phrase, r[3] AS word
               FROM regexp_matches(q, tokens, 'g') AS r LOOP
        neg := tok.sign = '-';
        item := NULL;
        IF tok.phrase IS NOT NULL THEN
            w := lower(btrim(regexp_replace(tok.phrase, '\s+', ' ', 'g')));
            IF w = '' THEN
                notes := notes || to_jsonb('an empty phrase was ignored'::text);
                CONTINUE;
            END IF;
            item := memory._grammar_item('phrase', w);
            is_strict := tok.sign = '+' OR NOT has_words;
            IF NOT neg AND NOT is_strict THEN
                -- a soft phrase: scored as plain words, raises what contains it, routed
                -- as its words (memory.optimize_query reads routing_text)
                boost := boost || item;
                scored := scored || w;
                routed := routed || tok.phrase;
                IF pending_or AND prev = 'required' THEN
                    groups := groups - (jsonb_array_length(groups) - 1);
                    optional := optional + 1;
                END IF;
                IF pending_or AND prev = 'excluded' THEN
                    notes := notes || to_jsonb('an OR next to an exclusion was ignored'::text);
                ELSIF pending_or THEN
                    n_or := n_or + 1;
                END IF;
                pending_or := false;
                prev := 'word';
                CONTINUE;
            END IF;
            routed := routed || (tok.sign || '"' || tok.phrase || '"');
        ELSE
            -- "+" only makes a phrase strict: before anything else it is part of the word
            word := CASE WHEN tok.sign = '+' THEN '+' ELSE '' END || tok.word;
            routed := routed || (CASE WHEN neg THEN '-' ELSE '' END || word);
            IF word = 'OR' AND NOT neg THEN
                IF prev IS NULL THEN
                    notes := notes || to_jsonb('an OR with nothing before it was ignored'::text);
                ELSE
                    pending_or := true;
                END IF;
                CONTINUE;
            END IF;
            -- Edge punctuation is not part of a tag or mention ("#networking," "@devops?").
            w := lower(regexp_replace(word, '[.,;:!?()\[\]{}''"]+$', ''));
            m := regexp_match(w, '^#(\w+(?:-\w+)*)$');
            IF m IS NOT NULL THEN
                item := memory._grammar_item('tag', m[1]);
            ELSE
                m := regexp_match(w, '^@(\w+(?:[.-]\w+)*)$');
                IF m IS NOT NULL THEN
                    item := memory._grammar_item('mention', m[1]);
                ELSIF neg AND w ~ '^[[:alpha:]]' THEN
                    item := memory._grammar_item('term', w);
                ELSE
                    -- a plain word ("-5" and "--" keep their dash: they exclude nothing)
                    scored := scored || (CASE WHEN neg THEN '-' ELSE '' END || word);
                    IF pending_or AND prev = 'required' THEN
                        -- "#a OR b": b alone satisfies it, so #a requires nothing
                        groups := groups - (jsonb_array_length(groups) - 1);
                        optional := optional + 1;
                    END IF;
                    IF pending_or AND prev = 'excluded' THEN
                        notes := notes || to_jsonb('an OR next to an exclusion was ignored'::text);
                    ELSIF pending_or THEN
                        n_or := n_or + 1;
                    END IF;
                    pending_or := false;
                    prev := 'word';
                    CONTINUE;
                END IF;
            END IF;
        END IF;
        IF neg THEN
            excl := excl || item;
            IF pending_or THEN
                notes := notes || to_jsonb('an OR next to an exclusion was ignored'::text);
            END IF;
            pending_or := false;
            prev := 'excluded';
            CONTINUE;
        END IF;
        scored := scored || (item ->> 'value');
        IF pending_or AND prev = 'required' THEN
            groups := jsonb_set(groups, ARRAY[(jsonb_array_length(groups) - 1)::text],
                                (groups -> -1) || item);
            n_or := n_or + 1;
        ELSIF pending_or AND prev = 'word' THEN
            optional := optional + 1;  -- "b OR #a": b alone satisfies it
            n_or := n_or + 1;
            pending_or := false;
            CONTINUE;
        ELSE
            IF pending_or THEN
                notes := notes || to_jsonb('an OR next to an exclusion was ignored'::text);
            END IF;
            groups := groups || jsonb_build_array(jsonb_build_array(item));
        END IF;
        pending_or := false;
        prev := 'required';
    END LOOP;
    IF pending_or THEN
        notes := notes || to_jsonb('an OR with nothing after it was ignored'::text);
    END IF;
    IF optional > 0 THEN
        notes := notes || to_jsonb(format('%s phrase, tag or mention OR-ed with a plain word: optional, scored only', optional));
    END IF;
    RETURN jsonb_build_object('operators', true, 'text', array_to_string(scored, ' '),
                              'required', groups, 'exclude', excl, 'boost', boost,
                              'or', n_or, 'notes', notes)
           -- the query as the optimizer routes it: a soft phrase by its words (it is no
           -- exact-match operator), the rest as written
           || CASE WHEN jsonb_array_length(boost) > 0
                   THEN jsonb_build_object('routing_text', array_to_string(routed, ' '))
                   ELSE '{}' END;
END $$;
COMMENT ON FUNCTION memory.parse_query(text) IS
    'How the query grammar reads a query (docs/sql-api.md, "Query grammar"): operators (false: plain words, every leg as before), text (what BM25 scores and the embedder reads: plain words, phrase words, tag and mention tokens), required (groups a result must satisfy, each by any of its items: strict phrases +"...", any phrase of a query without plain words, tags, mentions joined by OR), exclude (terms, phrases, tags, mentions no result may contain), boost (the soft phrases of a question: never required, the fused candidates containing them rank first), or (how many ORs joined operands), notes (malformed syntax read as plain words, ignored operators) and, with a soft phrase, routing_text (the query with its soft phrases unquoted: what the optimizer routes). Raises only for a query longer than QUERY_MAX_CHARS (@vocabulary.query_max_chars@, memory.check_query''s 22023), before reading it.';

-- The text a node is tested on for tags, mentions and stop-word phrases: what BM25 indexes.
CREATE OR REPLACE FUNCTION memory._grammar_doc(title text, breadcrumb text[], body text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN coalesce(title, '') || ' ' || coalesce(array_to_string(breadcrumb, ' '), '') || ' ' || body;
COMMENT ON FUNCTION memory._grammar_doc(text, text[], text) IS
    'The text the query grammar tests a node''s tags, mentions and stop-word phrases on: title, breadcrumb and body, as memory.lexical_document indexes them.';

CREATE OR REPLACE FUNCTION memory._grammar_has(tsv tsvector, doc text, item jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF item ? 'tsquery' THEN
        -- an excluded term also by its exact word, so "-nginx" holds whatever the stemmer does
        RETURN tsv @@ (item ->> 'tsquery')::tsquery
               OR (item ->> 'kind' = 'term' AND doc ~* (memory._grammar_pattern(item ->> 'value')));
    END IF;
    RETURN doc ~* (item ->> 'pattern');
END $$;
COMMENT ON FUNCTION memory._grammar_has(tsvector, text, jsonb) IS
    'Whether a node (its tsvector and memory._grammar_doc text) contains one grammar operand (memory._grammar_item).';

CREATE OR REPLACE FUNCTION memory._grammar_match(tsv tsvector, doc text, g jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    item jsonb;
    grp jsonb;
    ok boolean;
BEGIN
    IF g IS NULL THEN
        RETURN true;
    END IF;
    FOR item IN SELECT x FROM jsonb_array_elements(g -> 'exclude') x LOOP
        IF memory._grammar_has(tsv, doc, item) THEN
            RETURN false;
        END IF;
    END LOOP;
    FOR grp IN SELECT x FROM jsonb_array_elements(g -> 'required') x LOOP
        ok := false;
        FOR item IN SELECT x FROM jsonb_array_elements(grp) x LOOP
            IF memory._grammar_has(tsv, doc, item) THEN
                ok := true;
                EXIT;
            END IF;
        END LOOP;
        IF NOT ok THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END $$;
COMMENT ON FUNCTION memory._grammar_match(tsvector, text, jsonb) IS
    'Whether a node satisfies a parse of memory.parse_query: it contains no excluded operand and, for every required group, one of its operands (true when g is NULL).';

-- Every operand a leg tests is one more test of every candidate row (a tsquery and a
-- regular expression): 290 exclusions took 1.2 s against 68 ms over LoCoMo's 5,078 nodes,
-- and 20-28 s on a loaded server (issue 43). A query may hold at most query_max_operands
-- (poimen_core.vocabulary QUERY_MAX_OPERANDS): phrases (strict or soft), exclusions, tags
-- and mentions together, however OR joins them (an operand OR-ed with a plain word is scored only and
-- tests nothing: it does not count).
CREATE OR REPLACE FUNCTION memory.check_grammar(g jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n_ex integer := jsonb_array_length(coalesce(g -> 'exclude', '[]'));
    n_req integer := coalesce((SELECT sum(jsonb_array_length(x))::integer
                               FROM jsonb_array_elements(coalesce(g -> 'required', '[]')) x), 0)
                     -- a soft phrase tests every fused candidate: it counts as one
                     + jsonb_array_length(coalesce(g -> 'boost', '[]'));
BEGIN
    IF n_ex + n_req > @vocabulary.query_max_operands@ THEN
        RAISE EXCEPTION 'query has % operands, at most % are allowed', n_ex + n_req, @vocabulary.query_max_operands@
            USING ERRCODE = '22023',
                  DETAIL = format('%s exclusions and %s phrases, tags or mentions required or raising.', n_ex, n_req),
                  HINT = format('At most %s phrases, -exclusions, #tags and @mentions together (docs/sql-api.md, "Query cost"); plain words are not counted.',
                                @vocabulary.query_max_operands@);
    END IF;
    RETURN g;
END $$;
COMMENT ON FUNCTION memory.check_grammar(jsonb) IS
    'Returns a parse (memory.parse_query) unchanged unless it holds more than the vocabulary''s QUERY_MAX_OPERANDS (@vocabulary.query_max_operands@) operands a leg tests each row by (phrases, strict or soft, exclusions, tags and mentions, OR-ed or not): then 22023 saying how many.';

CREATE OR REPLACE FUNCTION memory._grammar_constraints(g jsonb)
RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- NULL when the parse constrains nothing, so a leg's filter folds away. Checked here too,
-- where every leg takes its constraints: a leg called on its own is bounded as a plan is.
RETURN CASE WHEN jsonb_array_length(coalesce(g -> 'required', '[]')) > 0
                 OR jsonb_array_length(coalesce(g -> 'exclude', '[]')) > 0
            THEN jsonb_build_object('required', memory.check_grammar(g) -> 'required', 'exclude', g -> 'exclude') END;
COMMENT ON FUNCTION memory._grammar_constraints(jsonb) IS
    'The part of a parse (memory.parse_query) a leg filters by: {"required", "exclude"}, or NULL when it has neither; 22023 for more operands than memory.check_grammar allows.';

-- The constraints of a parse compiled once per query, so a leg tests each row with inline
-- operators instead of a function call walking JSON: the exclusions as one tsquery (their
-- tsqueries OR-ed) and one regex (the exact words and tokens, alternated); each required
-- group as a tsquery and a regex, either of which satisfies it (NULL: none of that kind).
CREATE OR REPLACE FUNCTION memory._grammar_compile(
    g jsonb, OUT ex_tsq tsquery, OUT ex_re text, OUT req_tsq tsquery[], OUT req_re text[]
)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    grp jsonb;
BEGIN
    -- a term by its exact word too (as memory._grammar_has), the rest by their pattern
    SELECT string_agg('(' || CASE WHEN e ? 'tsquery' THEN memory._grammar_pattern(e ->> 'value')
                                   ELSE e ->> 'pattern' END || ')', '|')
      INTO ex_re
      FROM jsonb_array_elements(coalesce(g -> 'exclude', '[]')) e
     WHERE e ->> 'kind' = 'term' OR NOT e ? 'tsquery';
    SELECT string_agg('(' || (e ->> 'tsquery') || ')', ' | ')::tsquery INTO ex_tsq
      FROM jsonb_array_elements(coalesce(g -> 'exclude', '[]')) e WHERE e ? 'tsquery';
    req_tsq := '{}';
    req_re := '{}';
    FOR grp IN SELECT x FROM jsonb_array_elements(coalesce(g -> 'required', '[]')) x LOOP
        req_tsq := req_tsq || (SELECT string_agg('(' || (i ->> 'tsquery') || ')', ' | ')::tsquery
                               FROM jsonb_array_elements(grp) i WHERE i ? 'tsquery');
        req_re := req_re || (SELECT string_agg('(' || (i ->> 'pattern') || ')', '|')
                             FROM jsonb_array_elements(grp) i WHERE i ? 'pattern');
    END LOOP;
END $$;
COMMENT ON FUNCTION memory._grammar_compile(jsonb) IS
    'A parse''s constraints (memory._grammar_constraints) compiled for inline row tests: ex_tsq and ex_re (a row containing either is excluded), req_tsq[i] and req_re[i] (a row satisfies group i when it matches either). The same test as memory._grammar_match.';
