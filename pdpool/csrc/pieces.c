/* The router's piece table: token ids of ASCII text through GPT-2's byte-level pre-tokenizer pieces, each piece's
 * ids cached, in C (pdpool.token_cache.PieceEncoder's ASCII path without a regex pass, a str per piece, a dict lookup
 * per piece and a JSON join per chunk in Python).
 *
 *   PieceTable(miss, capacity)     miss(piece: str) -> list[int]: the BPE model's ids of a piece not seen yet
 *   table.encode(text) -> (ids, b"1,2,3")   text: an ASCII str; the ids and their JSON without the brackets
 *   chunks(text, chunk_chars) -> [str]      TokenChunkCache's cuts (pdpool/token_cache.py), any str
 *   hash_chain(parent, tokens, step, tail)  the engines' chained block hashes (pdpool/block_hash.py), SHA-256 here
 *   sha256_path([name]) -> str              "sha-ni" (x86 SHA extensions, chosen at load where the CPU has them)
 *                                           or "portable"; naming one switches to it (the tests check both)
 *   ApproxTable(capacity)                   the router's approximate prefix index (router/prefix_index.py), below
 *   ChunkLRU(capacity, encode_fresh)        TokenChunkCache's chunk LRU and per-request loop (pdpool/token_cache.py)
 *
 * The pieces are those of the GPT-2 pattern on ASCII text (White_Space = \t \n \v \f \r and space):
 *   's|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\s A-Za-z0-9]+|\s+(?!\S)|\s+
 * tests/router/test_token_cache.py checks the pieces against the pattern and the ids against the tokenizer.
 * The table holds at most `capacity` pieces; it is emptied when full (as PieceEncoder's dict is). One thread. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { OTHER = 0, LETTER = 1, DIGIT = 2, SPACE = 3 };
static unsigned char kind[128];

static void init_kinds(void) {
    for (int c = 0; c < 128; c++) kind[c] = OTHER;
    for (int c = 'a'; c <= 'z'; c++) kind[c] = LETTER;
    for (int c = 'A'; c <= 'Z'; c++) kind[c] = LETTER;
    for (int c = '0'; c <= '9'; c++) kind[c] = DIGIT;
    kind['\t'] = kind['\n'] = kind['\v'] = kind['\f'] = kind['\r'] = kind[' '] = SPACE;
}

/* Length of the piece starting at s[i] (i < n). */
static Py_ssize_t piece_len(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    unsigned char c = s[i];
    if (c == '\'' && i + 1 < n) {
        unsigned char d = s[i + 1];
        if (d == 's' || d == 't' || d == 'm' || d == 'd') return 2;
        if (i + 2 < n && ((d == 'r' && s[i + 2] == 'e') || (d == 'v' && s[i + 2] == 'e') ||
                          (d == 'l' && s[i + 2] == 'l')))
            return 3;
    }
    Py_ssize_t j = i;
    if (c == ' ' && i + 1 < n && kind[s[i + 1]] != SPACE) j = i + 1;   /* " ?" then a letter, digit or other run */
    int k = kind[s[j]];
    if (k != SPACE) {
        Py_ssize_t e = j + 1;
        while (e < n && kind[s[e]] == k) e++;
        return e - i;
    }
    Py_ssize_t e = i + 1;                 /* whitespace: the run, less its last character when a non-space follows */
    while (e < n && kind[s[e]] == SPACE) e++;
    if (e == n || e - i == 1) return e - i;
    return e - i - 1;
}

typedef struct {
    uint64_t hash;        /* 0: empty slot */
    char *key;            /* one allocation: key bytes, then the ids' JSON */
    Py_ssize_t key_len, json_len, num_ids;
    PyObject **ids;       /* owned references to the ids (ints) */
} Slot;

typedef struct {
    PyObject_HEAD
    PyObject *miss;
    Slot *slots;
    Py_ssize_t mask, count, capacity;
    /* scratch, reused across calls */
    PyObject **out_ids;
    Py_ssize_t out_len, out_cap;
    char *out_json;
    Py_ssize_t json_len, json_cap;
} PieceTable;

static uint64_t fnv1a(const unsigned char *s, Py_ssize_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++) { h ^= s[i]; h *= 1099511628211ULL; }
    return h ? h : 1;
}

static void free_slot(Slot *slot) {
    for (Py_ssize_t i = 0; i < slot->num_ids; i++) Py_DECREF(slot->ids[i]);
    PyMem_Free(slot->ids);
    PyMem_Free(slot->key);
    memset(slot, 0, sizeof *slot);
}

static void clear_slots(PieceTable *self) {
    if (self->slots == NULL) return;
    for (Py_ssize_t i = 0; i <= self->mask; i++)
        if (self->slots[i].hash) free_slot(&self->slots[i]);
    self->count = 0;
}

/* Fill `slot` with the ids miss(piece) returns, and their JSON; -1 with an exception set on failure. */
static int fill_slot(PieceTable *self, Slot *slot, uint64_t h, const unsigned char *s, Py_ssize_t n) {
    PyObject *piece = PyUnicode_FromKindAndData(PyUnicode_1BYTE_KIND, s, n);
    if (piece == NULL) return -1;
    PyObject *result = PyObject_CallOneArg(self->miss, piece);
    Py_DECREF(piece);
    if (result == NULL) return -1;
    PyObject *seq = PySequence_Fast(result, "the miss callback must return a list of ints");
    Py_DECREF(result);
    if (seq == NULL) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    char *buf = PyMem_Malloc(n + 21 * (m ? m : 1));
    PyObject **ids = PyMem_Malloc(sizeof(PyObject *) * (m ? m : 1));
    if (buf == NULL || ids == NULL) {
        PyMem_Free(buf); PyMem_Free(ids); Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, s, n);
    Py_ssize_t j = n;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *id = items[i];
        long long v = PyLong_Check(id) && !PyBool_Check(id) ? PyLong_AsLongLong(id) : -1;
        if (v < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "the miss callback returned a non-id");
            for (Py_ssize_t k = 0; k < i; k++) Py_DECREF(ids[k]);
            PyMem_Free(buf); PyMem_Free(ids); Py_DECREF(seq);
            return -1;
        }
        Py_INCREF(id);
        ids[i] = id;
        if (i) buf[j++] = ',';
        j += snprintf(buf + j, 21, "%lld", v);
    }
    Py_DECREF(seq);
    slot->hash = h;
    slot->key = buf;
    slot->key_len = n;
    slot->json_len = j - n;
    slot->ids = ids;
    slot->num_ids = m;
    self->count++;
    return 0;
}

static Slot *lookup(PieceTable *self, const unsigned char *s, Py_ssize_t n) {
    uint64_t h = fnv1a(s, n);
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)self->mask);
    for (;;) {
        Slot *slot = &self->slots[i];
        if (slot->hash == 0) {
            if (self->count >= self->capacity) {   /* full: start over, as PieceEncoder does */
                clear_slots(self);
                i = (Py_ssize_t)(h & (uint64_t)self->mask);
                slot = &self->slots[i];
            }
            return fill_slot(self, slot, h, s, n) < 0 ? NULL : slot;
        }
        if (slot->hash == h && slot->key_len == n && memcmp(slot->key, s, n) == 0) return slot;
        i = (i + 1) & self->mask;
    }
}

static int reserve(PieceTable *self, Py_ssize_t ids, Py_ssize_t json) {
    if (self->out_len + ids > self->out_cap) {
        Py_ssize_t cap = (self->out_len + ids) * 2;
        PyObject **p = PyMem_Realloc(self->out_ids, sizeof(PyObject *) * cap);
        if (p == NULL) { PyErr_NoMemory(); return -1; }
        self->out_ids = p;
        self->out_cap = cap;
    }
    if (self->json_len + json > self->json_cap) {
        Py_ssize_t cap = (self->json_len + json) * 2;
        char *p = PyMem_Realloc(self->out_json, cap);
        if (p == NULL) { PyErr_NoMemory(); return -1; }
        self->out_json = p;
        self->json_cap = cap;
    }
    return 0;
}

static void drop_output(PieceTable *self) {
    for (Py_ssize_t i = 0; i < self->out_len; i++) Py_DECREF(self->out_ids[i]);
    self->out_len = 0;
}

static PyObject *encode(PieceTable *self, PyObject *text) {
    if (!PyUnicode_Check(text) || !PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "PieceTable.encode takes an ASCII str");
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    self->out_len = self->json_len = 0;
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t len = piece_len(s, i, n);
        Slot *slot = lookup(self, s + i, len);
        if (slot == NULL || reserve(self, slot->num_ids, slot->json_len + 1) < 0) {
            drop_output(self);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < slot->num_ids; k++) {   /* owned: a full table is emptied mid-text */
            Py_INCREF(slot->ids[k]);
            self->out_ids[self->out_len++] = slot->ids[k];
        }
        if (slot->num_ids) {
            if (self->json_len) self->out_json[self->json_len++] = ',';
            memcpy(self->out_json + self->json_len, slot->key + slot->key_len, slot->json_len);
            self->json_len += slot->json_len;
        }
        i += len;
    }
    PyObject *ids = PyList_New(self->out_len);
    if (ids == NULL) {
        drop_output(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->out_len; i++) PyList_SET_ITEM(ids, i, self->out_ids[i]);   /* steals */
    self->out_len = 0;
    PyObject *json = PyBytes_FromStringAndSize(self->out_json, self->json_len);
    if (json == NULL) { Py_DECREF(ids); return NULL; }
    PyObject *pair = PyTuple_Pack(2, ids, json);
    Py_DECREF(ids);
    Py_DECREF(json);
    return pair;
}

static PyObject *pieces(PieceTable *Py_UNUSED(self), PyObject *text) {   /* the cuts alone, for the tests */
    if (!PyUnicode_Check(text) || !PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "PieceTable.pieces takes an ASCII str");
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n;) {
        Py_ssize_t len = piece_len(s, i, n);
        PyObject *p = PyUnicode_FromKindAndData(PyUnicode_1BYTE_KIND, s + i, len);
        if (p == NULL || PyList_Append(out, p) < 0) Py_CLEAR(out);
        Py_XDECREF(p);
        i += len;
    }
    return out;
}

static PyObject *clear(PieceTable *self, PyObject *Py_UNUSED(unused)) {
    clear_slots(self);
    Py_RETURN_NONE;
}

static int init(PieceTable *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"miss", "capacity", NULL};
    PyObject *miss;
    Py_ssize_t capacity = 200000;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n", names, &miss, &capacity)) return -1;
    if (!PyCallable_Check(miss) || capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "PieceTable(miss: callable, capacity >= 1)");
        return -1;
    }
    if (self->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PieceTable initialized twice");
        return -1;
    }
    Py_ssize_t size = 16;
    while (size < 2 * capacity) size *= 2;   /* at most half full */
    self->slots = PyMem_Calloc(size, sizeof(Slot));
    if (self->slots == NULL) { PyErr_NoMemory(); return -1; }
    self->mask = size - 1;
    self->capacity = capacity;
    Py_INCREF(miss);
    self->miss = miss;
    return 0;
}

static void dealloc(PieceTable *self) {
    clear_slots(self);
    PyMem_Free(self->slots);
    PyMem_Free(self->out_ids);
    PyMem_Free(self->out_json);
    Py_XDECREF(self->miss);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t length(PieceTable *self) { return self->count; }

/* chunks(text, chunk_chars): TokenChunkCache's cuts, any str: from `chunk_chars` on, cut right before the first
 * space whose preceding character is not whitespace (str.isspace, as re's \S), then again `chunk_chars` later. */
static PyObject *chunks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "chunks(text: str, chunk_chars: int)");
        return NULL;
    }
    PyObject *text = args[0];
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step < 1) step = 1;
    int ukind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), start = 0, pos = step;
    PyObject *out = PyList_New(0);
    while (out != NULL && pos < n) {
        Py_ssize_t m = pos;
        while (m < n && !(PyUnicode_READ(ukind, data, m) == ' ' &&
                          !Py_UNICODE_ISSPACE(PyUnicode_READ(ukind, data, m - 1))))
            m++;
        if (m >= n) break;
        PyObject *chunk = PyUnicode_Substring(text, start, m);
        if (chunk == NULL || PyList_Append(out, chunk) < 0) Py_CLEAR(out);
        Py_XDECREF(chunk);
        start = m;
        pos = m + step;
    }
    if (out != NULL) {
        PyObject *chunk = PyUnicode_Substring(text, start, n);
        if (chunk == NULL || PyList_Append(out, chunk) < 0) Py_CLEAR(out);
        Py_XDECREF(chunk);
    }
    return out;
}

/* SHA-256 (FIPS 180-4), for hash_chain below. */
static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_compress(uint32_t st[8], const unsigned char *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

static void sha256_compress_blocks(uint32_t st[8], const unsigned char *p, size_t blocks) {
    for (size_t k = 0; k < blocks; k++) sha256_compress(st, p + 64 * k);
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI 1

/* The same compression with the x86 SHA extensions (Intel since Goldmont/Ice Lake, AMD since Zen): 4 rounds per
 * pair of sha256rnds2, the message schedule by sha256msg1/msg2. The state is kept as ABEF/CDGH, as the
 * instructions want it. Only called where the CPU has them (sha_ni_usable). */
__attribute__((target("sha,sse4.1")))
static void sha256_compress_ni(uint32_t st[8], const unsigned char *p, size_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[0]), 0xB1);     /* CDAB */
    __m128i state1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[4]), 0x1B);  /* EFGH */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8);                                     /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);                                          /* CDGH */
    for (size_t b = 0; b < blocks; b++, p += 64) {
        __m128i abef = state0, cdgh = state1, w[4];
        for (int i = 0; i < 4; i++) w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
        for (int r = 0; r < 16; r++) {   /* rounds 4r .. 4r+3; w[r % 4] holds W[4r .. 4r+3] */
            __m128i wk = _mm_add_epi32(w[r & 3], _mm_loadu_si128((const __m128i *)&K256[4 * r]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, wk);
            state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(wk, 0x0E));
            if (r < 12) {                /* W[4r+16 .. 4r+19] replaces W[4r .. 4r+3] */
                __m128i x = _mm_sha256msg1_epu32(w[r & 3], w[(r + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(r + 3) & 3], w[(r + 2) & 3], 4));
                w[r & 3] = _mm_sha256msg2_epu32(x, w[(r + 3) & 3]);
            }
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);                                                /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);                                             /* DCHG */
    _mm_storeu_si128((__m128i *)&st[0], _mm_blend_epi16(tmp, state1, 0xF0));              /* DCBA */
    _mm_storeu_si128((__m128i *)&st[4], _mm_alignr_epi8(state1, tmp, 8));                 /* HGFE */
}

static int sha_ni_usable(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1)) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1;   /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#else
static int sha_ni_usable(void) { return 0; }
#endif

/* The compression in use: the SHA extensions where the CPU has them (set at import), else the portable code. */
static void (*compress_blocks)(uint32_t st[8], const unsigned char *p, size_t blocks) = sha256_compress_blocks;

static void sha256(const unsigned char *msg, size_t n, unsigned char out[32]) {
    uint32_t st[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t i = n & ~(size_t)63;
    compress_blocks(st, msg, i / 64);
    unsigned char last[128] = {0};
    size_t rest = n - i;
    memcpy(last, msg + i, rest);
    last[rest] = 0x80;
    size_t blocks = rest + 9 <= 64 ? 1 : 2;
    uint64_t bits = (uint64_t)n * 8;
    for (int k = 0; k < 8; k++) last[blocks * 64 - 1 - k] = (unsigned char)(bits >> (8 * k));
    compress_blocks(st, last, blocks);
    for (int k = 0; k < 8; k++) {
        out[4 * k] = (unsigned char)(st[k] >> 24); out[4 * k + 1] = (unsigned char)(st[k] >> 16);
        out[4 * k + 2] = (unsigned char)(st[k] >> 8); out[4 * k + 3] = (unsigned char)st[k];
    }
}

/* hash_chain(parent, tokens, tail) -> [16-byte hashes]: pdpool.block_hash.extend_block_hashes' loop, bit for bit.
 * tokens: the new full blocks' ids as <u32, len(tokens) // step blocks of `step` bytes each (step = 4 * block
 * size, passed as the third argument); each hash is
 *     sha256(<u32 len(parent)> parent <u32 step> tokens[i*step:(i+1)*step] tail)[:16]
 * chained: the next block's parent is this hash. */
static PyObject *hash_chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "hash_chain(parent: bytes, tokens: bytes, step: int, tail: bytes)");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[2]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t plen = PyBytes_GET_SIZE(args[0]), tlen = PyBytes_GET_SIZE(args[1]), xlen = PyBytes_GET_SIZE(args[3]);
    if (plen != 16 || step < 1 || step > 0xffffffffLL || tlen % step) {
        PyErr_SetString(PyExc_ValueError, "hash_chain: a 16-byte parent and whole blocks of `step` bytes");
        return NULL;
    }
    const unsigned char *tokens = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t mlen = 4 + 16 + 4 + step + xlen, count = tlen / step;
    unsigned char *msg = PyMem_Malloc(mlen);
    PyObject *out = PyList_New(count);
    if (msg == NULL || out == NULL) {
        PyMem_Free(msg); Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    msg[0] = 16; msg[1] = msg[2] = msg[3] = 0;
    memcpy(msg + 4, PyBytes_AS_STRING(args[0]), 16);
    for (int k = 0; k < 4; k++) msg[20 + k] = (unsigned char)((uint64_t)step >> (8 * k));
    memcpy(msg + 24 + step, PyBytes_AS_STRING(args[3]), xlen);
    unsigned char digest[32];
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(msg + 24, tokens + i * step, step);
        sha256(msg, mlen, digest);
        PyObject *h = PyBytes_FromStringAndSize((const char *)digest, 16);
        if (h == NULL) { Py_DECREF(out); PyMem_Free(msg); return NULL; }
        PyList_SET_ITEM(out, i, h);
        memcpy(msg + 4, digest, 16);
    }
    PyMem_Free(msg);
    return out;
}

/* sha256_path() -> the compression in use, "sha-ni" or "portable"; sha256_path(name) switches to it first
 * ("sha-ni" where the CPU lacks it: ValueError). For the tests, which check both paths against hashlib. */
static PyObject *sha256_path(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1 || (nargs == 1 && !PyUnicode_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "sha256_path(name: str = None)");
        return NULL;
    }
    if (nargs == 1) {
        const char *name = PyUnicode_AsUTF8(args[0]);
        if (name == NULL) return NULL;
        if (strcmp(name, "portable") == 0) {
            compress_blocks = sha256_compress_blocks;
#ifdef HAVE_SHA_NI
        } else if (strcmp(name, "sha-ni") == 0 && sha_ni_usable()) {
            compress_blocks = sha256_compress_ni;
#endif
        } else {
            PyErr_Format(PyExc_ValueError, "sha256_path: %R is not a SHA-256 path of this CPU (\"portable\"%s)",
                         args[0], sha_ni_usable() ? ", \"sha-ni\"" : "");
            return NULL;
        }
    }
    return PyUnicode_FromString(compress_blocks == sha256_compress_blocks ? "portable" : "sha-ni");
}

/* ---- Table: the LRU-bounded hash table under ApproxTable and ChunkLRU ------------------------------------------
 *
 * Entries in one array (each type's own struct, Links first), in an intrusive doubly linked LRU list; over them an
 * open-addressing index of {32-bit hash, entry index} (linear probing, at most half full, backward-shift deletion:
 * no tombstones). The keys, their hash and their comparison stay with each type: the index keeps the hash, enough
 * to grow and to find an entry's own slot without its key. The functions take the entry struct's size (`stride`),
 * a constant once inlined. One thread (the GIL); each type's `busy` keeps its callbacks out. */

typedef struct { int32_t prev, next; } Links;   /* LRU: prev is older, next newer; -1 at the ends */

typedef struct { uint32_t hash; int32_t entry; } HSlot;   /* entry -1: empty */

typedef struct {
    void *entries;               /* entries_cap entries of `stride` bytes, the first `count` in use */
    int32_t count, entries_cap;
    HSlot *slots;
    uint32_t mask;               /* the number of slots (a power of two) less one */
    int32_t oldest, newest;      /* the LRU list's ends, -1 when empty */
} Table;

/* Key comparison: 1 if entry e holds `key`, 0 if not, -1 with an error set. */
typedef int (*SameKey)(const void *entries, int32_t e, const void *key);

static int table_init(Table *t) {
    t->entries = NULL;
    t->count = t->entries_cap = 0;
    t->oldest = t->newest = -1;
    t->mask = 15;
    t->slots = PyMem_Malloc(sizeof(HSlot) * 16);
    if (t->slots == NULL) { PyErr_NoMemory(); return -1; }
    memset(t->slots, 0xff, sizeof(HSlot) * 16);
    return 0;
}

static void table_free(Table *t) {   /* the entries' own references are the type's to drop first */
    PyMem_Free(t->entries);
    PyMem_Free(t->slots);
}

static inline Links *links_at(Table *t, size_t stride, int32_t e) {
    return (Links *)((char *)t->entries + (size_t)e * stride);
}

/* The entry holding `key`, -1 if none, -2 when `same` failed. `same` is asked only where the hash matches. */
static inline int32_t table_find(const Table *t, uint32_t hash, SameKey same, const void *key) {
    for (uint32_t i = hash & t->mask;; i = (i + 1) & t->mask) {
        const HSlot *s = &t->slots[i];
        if (s->entry < 0) return -1;
        if (s->hash == hash) {
            int eq = same(t->entries, s->entry, key);
            if (eq) return eq < 0 ? -2 : s->entry;
        }
    }
}

/* Entry e into the first empty slot from its home: its key is known absent, so none is compared. */
static inline void slot_place(HSlot *slots, uint32_t mask, uint32_t hash, int32_t e) {
    uint32_t i = hash & mask;
    while (slots[i].entry >= 0) i = (i + 1) & mask;
    slots[i] = (HSlot){hash, e};
}

static void slot_delete(Table *t, uint32_t i) {   /* backward shift: no tombstones */
    uint32_t mask = t->mask, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].entry < 0) break;
        uint32_t home = t->slots[j].hash & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {   /* its home is not in (i, j]: it may move back to i */
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].entry = -1;
}

static int table_grow(Table *t) {   /* twice the slots, placed again from the stored hashes */
    size_t size = ((size_t)t->mask + 1) * 2;
    HSlot *slots = PyMem_Malloc(sizeof(HSlot) * size);
    if (slots == NULL) { PyErr_NoMemory(); return -1; }
    memset(slots, 0xff, sizeof(HSlot) * size);
    for (size_t i = 0; i <= t->mask; i++)
        if (t->slots[i].entry >= 0) slot_place(slots, (uint32_t)(size - 1), t->slots[i].hash, t->slots[i].entry);
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = (uint32_t)(size - 1);
    return 0;
}

static inline void lru_unlink(Table *t, size_t stride, int32_t e) {
    Links *x = links_at(t, stride, e);
    if (x->prev >= 0) links_at(t, stride, x->prev)->next = x->next; else t->oldest = x->next;
    if (x->next >= 0) links_at(t, stride, x->next)->prev = x->prev; else t->newest = x->prev;
}

static inline void lru_append(Table *t, size_t stride, int32_t e) {
    Links *x = links_at(t, stride, e);
    x->prev = t->newest;
    x->next = -1;
    if (t->newest >= 0) links_at(t, stride, t->newest)->next = e; else t->oldest = e;
    t->newest = e;
}

static inline void lru_touch(Table *t, size_t stride, int32_t e) {   /* e is now the most recently used */
    if (e != t->newest) {
        lru_unlink(t, stride, e);
        lru_append(t, stride, e);
    }
}

/* Entry e (its key's hash `hash`) out of the index and the list, for reuse: its slot is the one naming e. */
static void table_remove(Table *t, size_t stride, int32_t e, uint32_t hash) {
    uint32_t i = hash & t->mask;
    while (t->slots[i].entry != e) i = (i + 1) & t->mask;
    slot_delete(t, i);
    lru_unlink(t, stride, e);
}

/* A fresh entry's index (entries kept up to `capacity`), the slots grown first so that they stay at most half
 * full; -1 with an error set. */
static int32_t table_new_entry(Table *t, size_t stride, Py_ssize_t capacity) {
    if (((size_t)t->count + 1) * 2 > (size_t)t->mask + 1 && table_grow(t) < 0) return -1;
    if (t->count == t->entries_cap) {
        Py_ssize_t cap = t->entries_cap ? (Py_ssize_t)t->entries_cap * 2 : 64;
        if (cap > capacity) cap = capacity;
        void *entries = PyMem_Realloc(t->entries, stride * (size_t)cap);
        if (entries == NULL) { PyErr_NoMemory(); return -1; }
        t->entries = entries;
        t->entries_cap = (int32_t)cap;
    }
    return t->count++;
}

/* Entry e, filled in and its key absent, indexed under `hash` as the most recently used. */
static inline void table_insert(Table *t, size_t stride, uint32_t hash, int32_t e) {
    slot_place(t->slots, t->mask, hash, e);
    lru_append(t, stride, e);
}

static int enter(int *busy, const char *type) {
    if (*busy) {
        PyErr_Format(PyExc_RuntimeError, "%s used from inside one of its own calls", type);
        return -1;
    }
    *busy = 1;
    return 0;
}

/* ---- ApproxTable: the router's approximate prefix index (router/prefix_index.py's PyApproxIndex, in C) ----------
 *
 *   ApproxTable(capacity)                          block hash -> its owners, LRU-bounded to `capacity` hashes
 *   table.record(hashes, node_id, incarnation, now=None)
 *   table.lookup(hashes, incarnations, since=None) -> {node_id: leading blocks}
 *   table.owner(h, node_id) -> (incarnation, time recorded) or None
 *   table.keys() -> the hashes, least recently used first;  len(table);  table.capacity
 *
 * The same answers as PyApproxIndex (tests/router/test_approx_index_native.py): see its docstrings. Differences, all
 * outside what the router passes: a hash must be a `bytes` of HASH_BYTES (16) bytes (TypeError, ValueError), as
 * extend_block_hashes makes them; node ids and incarnations are compared as dict keys (hash and ==), as str and
 * None are; times are kept as C doubles (owner() gives a float); a negative capacity is a ValueError.
 *
 * Layout: a Table (above) of entries keyed by the 16 bytes, each with its first owner inline (the usual case: one
 * node) and any further owners in a small array. Node ids and incarnations are interned to small ints (a dict and
 * an array of owned references), counted by the owners that name them and released when none does, so a restarted
 * node's old incarnation goes with its last entry. One thread (the GIL). */

#define APPROX_KEY 16

typedef struct { int32_t node, inc; double time; } Owner;

typedef struct {
    Links lru;                   /* first: the Table's */
    unsigned char key[APPROX_KEY];
    int32_t n_owners, cap_more;  /* owners: `one`, then n_owners - 1 in `more` */
    Owner one;
    Owner *more;                 /* kept across the entry's reuse after an eviction */
} Entry;

typedef struct {
    PyObject *ids;               /* dict: object -> its index (int) */
    PyObject **objs;             /* index -> the object (owned), NULL when free */
    Py_ssize_t *refs;            /* index -> owners naming it, plus the running call's hold */
    int32_t *query;              /* index -> lookup's query slot, else -1 (used for node ids) */
    int32_t *free_ids;           /* indices free for reuse */
    int32_t used, cap, n_free;
} Interner;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    Table t;                     /* of Entry */
    Interner nodes, incs;
    int busy;
} ApproxTable;

static PyObject *monotonic;      /* time.monotonic, for record(now=None) */

static int interner_init(Interner *in) {
    memset(in, 0, sizeof *in);
    in->ids = PyDict_New();
    return in->ids == NULL ? -1 : 0;
}

static void interner_free(Interner *in) {
    for (int32_t i = 0; i < in->used; i++) Py_XDECREF(in->objs[i]);
    Py_XDECREF(in->ids);
    PyMem_Free(in->objs); PyMem_Free(in->refs); PyMem_Free(in->query); PyMem_Free(in->free_ids);
    memset(in, 0, sizeof *in);
}

/* The object's index, -1 if not interned, -2 with an exception set (unhashable). */
static int32_t intern_get(Interner *in, PyObject *o) {
    PyObject *v = PyDict_GetItemWithError(in->ids, o);
    if (v == NULL) return PyErr_Occurred() ? -2 : -1;
    return (int32_t)PyLong_AsLong(v);
}

/* The object's index, interned if new, with one more reference counted on it; -1 with an exception set. */
static int32_t intern_hold(Interner *in, PyObject *o) {
    int32_t i = intern_get(in, o);
    if (i == -2) return -1;
    if (i >= 0) {
        in->refs[i]++;
        return i;
    }
    if (in->n_free) {
        i = in->free_ids[--in->n_free];
    } else {
        if (in->used == in->cap) {
            int32_t cap = in->cap ? in->cap * 2 : 8;
            PyObject **objs = PyMem_Realloc(in->objs, sizeof(PyObject *) * cap);
            if (objs != NULL) in->objs = objs;
            Py_ssize_t *refs = objs ? PyMem_Realloc(in->refs, sizeof(Py_ssize_t) * cap) : NULL;
            if (refs != NULL) in->refs = refs;
            int32_t *query = refs ? PyMem_Realloc(in->query, sizeof(int32_t) * cap) : NULL;
            if (query != NULL) in->query = query;
            int32_t *free_ids = query ? PyMem_Realloc(in->free_ids, sizeof(int32_t) * cap) : NULL;
            if (free_ids == NULL) { PyErr_NoMemory(); return -1; }
            in->free_ids = free_ids;
            for (int32_t k = in->cap; k < cap; k++) in->query[k] = -1;
            in->cap = cap;
        }
        i = in->used++;
        in->objs[i] = NULL;
    }
    PyObject *index = PyLong_FromLong(i);
    if (index == NULL || PyDict_SetItem(in->ids, o, index) < 0) {
        Py_XDECREF(index);
        in->free_ids[in->n_free++] = i;
        return -1;
    }
    Py_DECREF(index);
    Py_INCREF(o);
    in->objs[i] = o;
    in->refs[i] = 1;
    return i;
}

static void intern_release(Interner *in, int32_t i) {
    if (--in->refs[i] > 0) return;
    PyObject *o = in->objs[i];
    if (PyDict_DelItem(in->ids, o) < 0) {   /* cannot fail for an interned key of a sane type: keep it */
        PyErr_Clear();
        in->refs[i] = 1;
        return;
    }
    in->objs[i] = NULL;
    in->free_ids[in->n_free++] = i;
    Py_DECREF(o);
}

static inline uint32_t key_hash(const unsigned char *k) {
    uint64_t a, b;
    memcpy(&a, k, 8);
    memcpy(&b, k + 8, 8);
    uint64_t h = a ^ (b * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 31; h *= 0xBF58476D1CE4E5B9ULL; h ^= h >> 29;
    return (uint32_t)(h >> 32);
}

static inline Entry *entry_at(ApproxTable *self, int32_t e) { return (Entry *)self->t.entries + e; }

static inline int same_block(const void *entries, int32_t e, const void *key) {
    return memcmp(((const Entry *)entries)[e].key, key, APPROX_KEY) == 0;
}

/* The entry of `key`, or -1. */
static inline int32_t find_block(ApproxTable *self, const unsigned char *key, uint32_t hash) {
    return table_find(&self->t, hash, same_block, key);
}

static inline Owner *owner_at(Entry *x, int32_t k) { return k == 0 ? &x->one : &x->more[k - 1]; }

static void release_owners(ApproxTable *self, Entry *x) {
    for (int32_t k = 0; k < x->n_owners; k++) {
        Owner *o = owner_at(x, k);
        intern_release(&self->nodes, o->node);
        intern_release(&self->incs, o->inc);
    }
    x->n_owners = 0;
}

/* `node`'s owner record of entry `e` set to (inc, time): updated in place, or added. */
static int set_owner(ApproxTable *self, int32_t e, int32_t node, int32_t inc, double time) {
    Entry *x = entry_at(self, e);
    for (int32_t k = 0; k < x->n_owners; k++) {
        Owner *o = owner_at(x, k);
        if (o->node == node) {
            if (o->inc != inc) {
                self->incs.refs[inc]++;
                intern_release(&self->incs, o->inc);
                o->inc = inc;
            }
            o->time = time;
            return 0;
        }
    }
    if (x->n_owners - 1 == x->cap_more) {
        int32_t cap = x->cap_more ? x->cap_more * 2 : 2;
        Owner *more = PyMem_Realloc(x->more, sizeof(Owner) * cap);
        if (more == NULL) { PyErr_NoMemory(); return -1; }
        x->more = more;
        x->cap_more = cap;
    }
    x->more[x->n_owners - 1] = (Owner){node, inc, time};
    x->n_owners++;
    self->nodes.refs[node]++;
    self->incs.refs[inc]++;
    return 0;
}

/* hashes as a sequence of HASH_BYTES-byte bytes (a new reference, from PySequence_Fast), or NULL with an error. */
static PyObject *hash_sequence(PyObject *hashes, const char *where) {
    PyObject *seq = PySequence_Fast(hashes, "the block hashes must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "ApproxTable.%s: block hash %zd is %.100s, not bytes", where, i,
                         Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
        if (PyBytes_GET_SIZE(items[i]) != APPROX_KEY) {
            PyErr_Format(PyExc_ValueError, "ApproxTable.%s: block hash %zd has %zd bytes, not %d", where, i,
                         PyBytes_GET_SIZE(items[i]), APPROX_KEY);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

/* Positional and keyword arguments into out[0..total) (NULL where not given); the first `required` must be. */
static int parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int required, int total, PyObject **out) {
    if (nargs > total) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, total, nargs);
        return -1;
    }
    for (int i = 0; i < total; i++) out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (name == NULL) return -1;
        int j = 0;
        while (j < total && strcmp(name, names[j]) != 0) j++;
        if (j == total) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fname, name);
            return -1;
        }
        if (out[j] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, name);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (int i = 0; i < required; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    return 0;
}

static PyObject *approx_record(ApproxTable *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"hashes", "node_id", "incarnation", "now"};
    PyObject *a[4];
    if (parse_args("record", args, nargs, kwnames, names, 3, 4, a) < 0) return NULL;
    double now;
    if (a[3] == NULL || a[3] == Py_None) {
        PyObject *t = PyObject_CallNoArgs(monotonic);
        if (t == NULL) return NULL;
        now = PyFloat_AsDouble(t);
        Py_DECREF(t);
    } else {
        if (!PyNumber_Check(a[3]) || PyComplex_Check(a[3])) {
            PyErr_Format(PyExc_TypeError, "ApproxTable.record: now must be a number or None, not %.100s",
                         Py_TYPE(a[3])->tp_name);
            return NULL;
        }
        now = PyFloat_AsDouble(a[3]);
    }
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *seq = hash_sequence(a[0], "record");
    if (seq == NULL) return NULL;
    if (enter(&self->busy, "ApproxTable") < 0) { Py_DECREF(seq); return NULL; }
    PyObject *result = NULL;
    int32_t node = intern_hold(&self->nodes, a[1]), inc = -1;   /* held for the call: an eviction may drop
                                                                   every other reference to them */
    if (node < 0 || (inc = intern_hold(&self->incs, a[2])) < 0) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < n; j++) {
        const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(items[j]);
        uint32_t hash = key_hash(key);
        int32_t e = find_block(self, key, hash);
        if (e >= 0) {                                   /* held: this node's record updated, most recent now */
            if (set_owner(self, e, node, inc, now) < 0) goto done;
            lru_touch(&self->t, sizeof(Entry), e);
            continue;
        }
        if (self->capacity == 0) continue;              /* added and evicted at once */
        Entry *x;
        if (self->t.count == self->capacity) {          /* full: the least recently used entry is reused */
            e = self->t.oldest;
            x = entry_at(self, e);
            release_owners(self, x);
            table_remove(&self->t, sizeof(Entry), e, key_hash(x->key));
        } else {
            if ((e = table_new_entry(&self->t, sizeof(Entry), self->capacity)) < 0) goto done;
            x = entry_at(self, e);
            x->more = NULL;
            x->cap_more = 0;
        }
        memcpy(x->key, key, APPROX_KEY);
        x->n_owners = 1;
        x->one = (Owner){node, inc, now};
        self->nodes.refs[node]++;
        self->incs.refs[inc]++;
        table_insert(&self->t, sizeof(Entry), hash, e);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (inc >= 0) intern_release(&self->incs, inc);
    if (node >= 0) intern_release(&self->nodes, node);
    self->busy = 0;
    Py_DECREF(seq);
    return result;
}

typedef struct { PyObject *key; Py_ssize_t matched; int32_t node, inc; } Query;

static PyObject *approx_lookup(ApproxTable *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"hashes", "incarnations", "since"};
    PyObject *a[3];
    if (parse_args("lookup", args, nargs, kwnames, names, 2, 3, a) < 0) return NULL;
    int windowed = a[2] != NULL && a[2] != Py_None;
    double since = 0.0;
    if (windowed) {
        if (!PyNumber_Check(a[2]) || PyComplex_Check(a[2])) {
            PyErr_Format(PyExc_TypeError, "ApproxTable.lookup: since must be a number or None, not %.100s",
                         Py_TYPE(a[2])->tp_name);
            return NULL;
        }
        since = PyFloat_AsDouble(a[2]);
        if (since == -1.0 && PyErr_Occurred()) return NULL;
    }
    PyObject *incarnations = PyDict_Check(a[1]) ? (Py_INCREF(a[1]), a[1])
                                                : PyObject_CallOneArg((PyObject *)&PyDict_Type, a[1]);
    if (incarnations == NULL) return NULL;
    PyObject *seq = hash_sequence(a[0], "lookup");
    if (seq == NULL) { Py_DECREF(incarnations); return NULL; }
    if (enter(&self->busy, "ApproxTable") < 0) { Py_DECREF(seq); Py_DECREF(incarnations); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t nq = PyDict_GET_SIZE(incarnations), q = 0, pending = 0, pos = 0;
    Query stack[16], *qs = nq <= 16 ? stack : PyMem_Malloc(sizeof(Query) * nq);
    if (qs == NULL) { PyErr_NoMemory(); goto done; }
    PyObject *k, *v;
    while (q < nq && PyDict_Next(incarnations, &pos, &k, &v)) {   /* the queried nodes, in the dict's order */
        Py_INCREF(k);
        Py_INCREF(v);
        qs[q] = (Query){k, 0, -1, -1};
        q++;
        int32_t node = intern_get(&self->nodes, k), inc = intern_get(&self->incs, v);
        Py_DECREF(v);
        if (node == -2 || inc == -2) goto done;
        qs[q - 1].inc = inc;
        if (node >= 0) {   /* a node never recorded (or with nothing left) matches nothing */
            qs[q - 1].node = node;
            self->nodes.query[node] = (int32_t)(q - 1);
            if (inc >= 0) pending++;
        }
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = n - 1; j >= 0 && pending; j--) {   /* from the end: the first valid entry is the match */
        const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(items[j]);
        int32_t e = find_block(self, key, key_hash(key));
        if (e < 0) continue;
        Entry *x = entry_at(self, e);
        for (int32_t o = 0; o < x->n_owners; o++) {
            Owner *w = owner_at(x, o);
            int32_t s = self->nodes.query[w->node];
            if (s >= 0 && qs[s].matched == 0 && w->inc == qs[s].inc && (!windowed || w->time >= since)) {
                qs[s].matched = j + 1;
                pending--;
            }
        }
    }
    result = PyDict_New();
    for (Py_ssize_t s = 0; result != NULL && s < q; s++) {
        PyObject *count = PyLong_FromSsize_t(qs[s].matched);
        if (count == NULL || PyDict_SetItem(result, qs[s].key, count) < 0) Py_CLEAR(result);
        Py_XDECREF(count);
    }
done:
    for (Py_ssize_t s = 0; s < q; s++) {
        if (qs[s].node >= 0) self->nodes.query[qs[s].node] = -1;
        Py_DECREF(qs[s].key);
    }
    if (qs != stack) PyMem_Free(qs);
    self->busy = 0;
    Py_DECREF(seq);
    Py_DECREF(incarnations);
    return result;
}

static PyObject *approx_owner(ApproxTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "owner(h: bytes, node_id)");
        return NULL;
    }
    PyObject *h = args[0];
    if (!PyBytes_Check(h)) {
        PyErr_Format(PyExc_TypeError, "ApproxTable.owner: the block hash is %.100s, not bytes", Py_TYPE(h)->tp_name);
        return NULL;
    }
    if (PyBytes_GET_SIZE(h) != APPROX_KEY) {
        PyErr_Format(PyExc_ValueError, "ApproxTable.owner: the block hash has %zd bytes, not %d",
                     PyBytes_GET_SIZE(h), APPROX_KEY);
        return NULL;
    }
    const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(h);
    int32_t e = find_block(self, key, key_hash(key));
    if (e < 0) Py_RETURN_NONE;
    if (enter(&self->busy, "ApproxTable") < 0) return NULL;
    int32_t node = intern_get(&self->nodes, args[1]);
    self->busy = 0;
    if (node == -2) return NULL;
    Entry *x = entry_at(self, e);
    for (int32_t k = 0; node >= 0 && k < x->n_owners; k++) {
        Owner *o = owner_at(x, k);
        if (o->node == node) {
            PyObject *time = PyFloat_FromDouble(o->time);
            if (time == NULL) return NULL;
            PyObject *pair = PyTuple_Pack(2, self->incs.objs[o->inc], time);
            Py_DECREF(time);
            return pair;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *approx_keys(ApproxTable *self, PyObject *Py_UNUSED(unused)) {
    PyObject *out = PyList_New(self->t.count);
    Py_ssize_t i = 0;
    for (int32_t e = self->t.oldest; out != NULL && e >= 0; e = entry_at(self, e)->lru.next) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)entry_at(self, e)->key, APPROX_KEY);
        if (key == NULL) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i++, key);
    }
    return out;
}

static PyObject *approx_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:ApproxTable", names, &capacity)) return NULL;
    if (capacity < 0 || capacity > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "ApproxTable(capacity): 0 <= capacity <= 2**30, not %zd", capacity);
        return NULL;
    }
    ApproxTable *self = (ApproxTable *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->capacity = capacity;
    if (table_init(&self->t) < 0) { Py_DECREF(self); return NULL; }
    if (interner_init(&self->nodes) < 0 || interner_init(&self->incs) < 0) { Py_DECREF(self); return NULL; }
    return (PyObject *)self;
}

static void approx_dealloc(ApproxTable *self) {
    for (int32_t e = 0; e < self->t.count; e++) PyMem_Free(entry_at(self, e)->more);
    table_free(&self->t);
    interner_free(&self->nodes);
    interner_free(&self->incs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t approx_length(ApproxTable *self) { return self->t.count; }

static PyMethodDef approx_methods[] = {
    {"record", (PyCFunction)(void (*)(void))approx_record, METH_FASTCALL | METH_KEYWORDS,
     "record(hashes, node_id, incarnation, now=None): the prompt's blocks were sent to node_id (most recent now)"},
    {"lookup", (PyCFunction)(void (*)(void))approx_lookup, METH_FASTCALL | METH_KEYWORDS,
     "lookup(hashes, incarnations, since=None) -> {node_id: leading blocks recorded under its incarnation}"},
    {"owner", (PyCFunction)(void (*)(void))approx_owner, METH_FASTCALL,
     "owner(h, node_id) -> (incarnation, time recorded) of node_id's entry for h, or None"},
    {"keys", (PyCFunction)approx_keys, METH_NOARGS, "keys() -> the block hashes, least recently used first"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef approx_members[] = {
    {"capacity", T_PYSSIZET, offsetof(ApproxTable, capacity), READONLY, "the most block hashes held"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods approx_as_sequence = {.sq_length = (lenfunc)approx_length};

static PyTypeObject ApproxTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdpool_router_pieces.ApproxTable",
    .tp_basicsize = sizeof(ApproxTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = approx_new,
    .tp_dealloc = (destructor)approx_dealloc,
    .tp_methods = approx_methods,
    .tp_members = approx_members,
    .tp_as_sequence = &approx_as_sequence,
    .tp_doc = "The router's approximate prefix index: block hash -> {node: (incarnation, time)}, LRU-bounded "
              "(router/prefix_index.py's PyApproxIndex, in C).",
};

/* ---- ChunkLRU: TokenChunkCache's chunk loop (pdpool/token_cache.py's encode_chunked), in C -------------------------
 *
 *   ChunkLRU(capacity, encode_fresh)      chunk text -> (ids, their JSON), LRU-bounded to `capacity` chunks;
 *                                         encode_fresh(chunk) -> (ids, JSON without brackets) or [ids, None]
 *   lru.run(chunks, ids, lead_json) -> (ids + every chunk's ids, b"[...]" of them all, shared, hits, misses)
 *       ids: the ids before the first chunk (a list, not changed), lead_json their JSON without brackets or None;
 *       shared: ((chunk, ids up to its end), ...) for the leading chunks that were cached already
 *   len(lru), lru.keys() (least recently used first)
 *
 * The same results and LRU order as the Python loop (tests/router/test_token_cache.py): a cached chunk is moved to
 * the most recent end; a missing one is encoded, added, and the least recently used one dropped beyond
 * `capacity`. Chunks are str; the ids lists are kept as given (not copied). One thread. */

typedef struct {
    Links lru;                    /* first: the Table's */
    PyObject *key, *ids, *json;   /* owned: str, list of ints, bytes */
    uint32_t hash;                /* the key's hash, as the Table keeps it */
} ChunkEntry;

typedef struct {
    PyObject_HEAD
    PyObject *encode_fresh;
    Py_ssize_t capacity;
    Table t;                      /* of ChunkEntry, keyed by str */
    int busy;
} ChunkLRU;

static inline ChunkEntry *chunk_at(ChunkLRU *self, int32_t e) { return (ChunkEntry *)self->t.entries + e; }

/* `key` (an exact or sub- str) against entry e's, lengths first; -1 with an error set. */
static inline int same_chunk(const void *entries, int32_t e, const void *key) {
    PyObject *other = ((const ChunkEntry *)entries)[e].key, *k = (PyObject *)key;
    if (other == k) return 1;
    if (PyUnicode_GET_LENGTH(other) != PyUnicode_GET_LENGTH(k)) return 0;
    int eq = PyUnicode_Compare(other, k);
    if (eq == -1 && PyErr_Occurred()) return -1;
    return eq == 0;
}

/* ",".join(map(str, ids)).encode(): the ids' JSON without brackets. */
static PyObject *ids_json(PyObject *ids) {
    Py_ssize_t n = PyList_GET_SIZE(ids), len = 0;
    char *buf = PyMem_Malloc(21 * (n ? n : 1));
    if (buf == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(id) ? PyLong_AsLongLongAndOverflow(id, &overflow) : 0;
        if (!PyLong_CheckExact(id) || overflow) {
            PyErr_SetString(PyExc_TypeError, "ChunkLRU: token ids must be ints of 64 bits");
            PyMem_Free(buf);
            return NULL;
        }
        if (i) buf[len++] = ',';
        len += snprintf(buf + len, 21, "%lld", v);
    }
    PyObject *out = PyBytes_FromStringAndSize(buf, len);
    PyMem_Free(buf);
    return out;
}

/* encode_fresh(chunk) as (ids: list, json: bytes), new references; -1 with an error set. */
static int chunk_encode(ChunkLRU *self, PyObject *chunk, PyObject **ids, PyObject **json) {
    PyObject *entry = PyObject_CallOneArg(self->encode_fresh, chunk);
    if (entry == NULL) return -1;
    PyObject **items = (PyTuple_Check(entry) || PyList_Check(entry)) && PySequence_Fast_GET_SIZE(entry) == 2
                       ? PySequence_Fast_ITEMS(entry) : NULL;
    if (items == NULL || !PyList_Check(items[0]) || !(items[1] == Py_None || PyBytes_Check(items[1]))) {
        PyErr_SetString(PyExc_TypeError, "ChunkLRU: encode_fresh must return (ids: list, json: bytes or None)");
        Py_DECREF(entry);
        return -1;
    }
    *ids = items[0];
    Py_INCREF(*ids);
    if (items[1] == Py_None) {
        *json = ids_json(*ids);
    } else {
        *json = items[1];
        Py_INCREF(*json);
    }
    Py_DECREF(entry);
    if (*json == NULL) { Py_CLEAR(*ids); return -1; }
    return 0;
}

static PyObject *chunk_run(ChunkLRU *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
        !(args[2] == Py_None || PyBytes_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "run(chunks: list[str], ids: list[int], lead_json: bytes | None)");
        return NULL;
    }
    PyObject *chunks = args[0], *lead = args[1], *lead_json = args[2];
    Py_ssize_t n = PyList_GET_SIZE(chunks);
    for (Py_ssize_t k = 0; k < n; k++)
        if (!PyUnicode_Check(PyList_GET_ITEM(chunks, k))) {
            PyErr_SetString(PyExc_TypeError, "ChunkLRU.run: the chunks must be str");
            return NULL;
        }
    if (enter(&self->busy, "ChunkLRU") < 0) return NULL;
    PyObject *result = NULL, *out_ids = NULL, *out_json = NULL, *shared = NULL;
    PyObject **got = PyMem_Calloc(2 * (n ? n : 1), sizeof(PyObject *));   /* per chunk: ids, json (owned) */
    Py_ssize_t hits = 0, misses = 0, n_shared = 0, total = PyList_GET_SIZE(lead);
    Py_ssize_t json_len = 2 + (lead_json != Py_None ? PyBytes_GET_SIZE(lead_json) : 0);
    int parts = lead_json != Py_None && PyList_GET_SIZE(lead) > 0;
    if (got == NULL) { PyErr_NoMemory(); goto done; }
    int in_prefix = 1;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *chunk = PyList_GET_ITEM(chunks, k);
        Py_hash_t hash = PyObject_Hash(chunk);
        if (hash == -1) goto done;
        int32_t e = table_find(&self->t, (uint32_t)hash, same_chunk, chunk);
        if (e == -2) goto done;
        if (e >= 0) {
            hits++;
            lru_touch(&self->t, sizeof(ChunkEntry), e);
            got[2 * k] = chunk_at(self, e)->ids;
            got[2 * k + 1] = chunk_at(self, e)->json;
            Py_INCREF(got[2 * k]);
            Py_INCREF(got[2 * k + 1]);
        } else {
            misses++;
            in_prefix = 0;
            if (chunk_encode(self, chunk, &got[2 * k], &got[2 * k + 1]) < 0) goto done;
            if (self->capacity > 0) {
                ChunkEntry *x;
                if (self->t.count == self->capacity) {   /* full: the least recently used entry is reused */
                    e = self->t.oldest;
                    x = chunk_at(self, e);
                    table_remove(&self->t, sizeof(ChunkEntry), e, x->hash);
                    Py_CLEAR(x->key); Py_CLEAR(x->ids); Py_CLEAR(x->json);
                } else {
                    if ((e = table_new_entry(&self->t, sizeof(ChunkEntry), self->capacity)) < 0) goto done;
                    x = chunk_at(self, e);
                }
                x->key = chunk; Py_INCREF(chunk);
                x->ids = got[2 * k]; Py_INCREF(x->ids);
                x->json = got[2 * k + 1]; Py_INCREF(x->json);
                x->hash = (uint32_t)hash;
                table_insert(&self->t, sizeof(ChunkEntry), x->hash, e);
            }
        }
        total += PyList_GET_SIZE(got[2 * k]);
        if (in_prefix) n_shared++;
        Py_ssize_t jl = PyBytes_GET_SIZE(got[2 * k + 1]);
        if (jl) { json_len += jl + (parts ? 1 : 0); parts = 1; }
    }
    out_ids = PyList_New(total);
    out_json = PyBytes_FromStringAndSize(NULL, json_len);
    shared = PyTuple_New(n_shared);
    if (out_ids == NULL || out_json == NULL || shared == NULL) goto done;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lead); i++, at++) {
        PyObject *id = PyList_GET_ITEM(lead, i);
        Py_INCREF(id);
        PyList_SET_ITEM(out_ids, at, id);
    }
    char *w = PyBytes_AS_STRING(out_json);
    *w++ = '[';
    parts = 0;
    if (lead_json != Py_None && PyList_GET_SIZE(lead) > 0) {
        memcpy(w, PyBytes_AS_STRING(lead_json), PyBytes_GET_SIZE(lead_json));
        w += PyBytes_GET_SIZE(lead_json);
        parts = 1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *ids = got[2 * k], *json = got[2 * k + 1];
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++, at++) {
            PyObject *id = PyList_GET_ITEM(ids, i);
            Py_INCREF(id);
            PyList_SET_ITEM(out_ids, at, id);
        }
        Py_ssize_t jl = PyBytes_GET_SIZE(json);
        if (jl) {
            if (parts) *w++ = ',';
            memcpy(w, PyBytes_AS_STRING(json), jl);
            w += jl;
            parts = 1;
        }
        if (k < n_shared) {
            PyObject *pair = Py_BuildValue("(On)", PyList_GET_ITEM(chunks, k), at);
            if (pair == NULL) goto done;
            PyTuple_SET_ITEM(shared, k, pair);
        }
    }
    *w++ = ']';
    result = Py_BuildValue("(OOOnn)", out_ids, out_json, shared, hits, misses);
done:
    Py_XDECREF(out_ids); Py_XDECREF(out_json); Py_XDECREF(shared);
    if (got != NULL) {
        for (Py_ssize_t k = 0; k < 2 * n; k++) Py_XDECREF(got[k]);
        PyMem_Free(got);
    }
    self->busy = 0;
    return result;
}

static PyObject *chunk_keys(ChunkLRU *self, PyObject *Py_UNUSED(unused)) {
    PyObject *out = PyList_New(self->t.count);
    Py_ssize_t i = 0;
    for (int32_t e = self->t.oldest; out != NULL && e >= 0; e = chunk_at(self, e)->lru.next) {
        Py_INCREF(chunk_at(self, e)->key);
        PyList_SET_ITEM(out, i++, chunk_at(self, e)->key);
    }
    return out;
}

static PyObject *chunk_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", "encode_fresh", NULL};
    Py_ssize_t capacity;
    PyObject *encode_fresh;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nO:ChunkLRU", names, &capacity, &encode_fresh)) return NULL;
    if (capacity < 0 || capacity > (1 << 30) || !PyCallable_Check(encode_fresh)) {
        PyErr_SetString(PyExc_ValueError, "ChunkLRU(capacity: 0 .. 2**30, encode_fresh: callable)");
        return NULL;
    }
    ChunkLRU *self = (ChunkLRU *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->capacity = capacity;
    if (table_init(&self->t) < 0) { Py_DECREF(self); return NULL; }
    Py_INCREF(encode_fresh);
    self->encode_fresh = encode_fresh;
    return (PyObject *)self;
}

static void chunk_dealloc(ChunkLRU *self) {
    for (int32_t e = 0; e < self->t.count; e++) {
        ChunkEntry *x = chunk_at(self, e);
        Py_XDECREF(x->key); Py_XDECREF(x->ids); Py_XDECREF(x->json);
    }
    table_free(&self->t);
    Py_XDECREF(self->encode_fresh);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t chunk_length(ChunkLRU *self) { return self->t.count; }

static PyMethodDef chunk_methods[] = {
    {"run", (PyCFunction)(void (*)(void))chunk_run, METH_FASTCALL,
     "run(chunks, ids, lead_json) -> (ids, b'[...]', shared, hits, misses): TokenChunkCache's chunk loop"},
    {"keys", (PyCFunction)chunk_keys, METH_NOARGS, "keys() -> the chunks, least recently used first"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods chunk_as_sequence = {.sq_length = (lenfunc)chunk_length};

static PyTypeObject ChunkLRUType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdpool_router_pieces.ChunkLRU",
    .tp_basicsize = sizeof(ChunkLRU),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = chunk_new,
    .tp_dealloc = (destructor)chunk_dealloc,
    .tp_methods = chunk_methods,
    .tp_as_sequence = &chunk_as_sequence,
    .tp_doc = "TokenChunkCache's LRU of chunk ids and their JSON, and its per-request loop (pdpool/token_cache.py).",
};

static PyMethodDef module_methods[] = {
    {"sha256_path", (PyCFunction)(void (*)(void))sha256_path, METH_FASTCALL,
     "sha256_path([name]) -> 'sha-ni' or 'portable': hash_chain's SHA-256 compression (naming one switches)"},
    {"chunks", (PyCFunction)(void (*)(void))chunks, METH_FASTCALL, "chunks(text, chunk_chars) -> list[str]"},
    {"hash_chain", (PyCFunction)(void (*)(void))hash_chain, METH_FASTCALL,
     "hash_chain(parent, tokens, step, tail) -> chained 16-byte block hashes (pdpool.block_hash's, in C)"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)encode, METH_O, "encode(text: ASCII str) -> (ids: list[int], ids JSON without brackets)"},
    {"pieces", (PyCFunction)pieces, METH_O, "pieces(text: ASCII str) -> the pre-tokenizer's pieces"},
    {"clear", (PyCFunction)clear, METH_NOARGS, "forget every piece"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods as_sequence = {.sq_length = (lenfunc)length};

static PyTypeObject PieceTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdpool_router_pieces.PieceTable",
    .tp_basicsize = sizeof(PieceTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)init,
    .tp_dealloc = (destructor)dealloc,
    .tp_methods = methods,
    .tp_as_sequence = &as_sequence,
    .tp_doc = "Token ids of ASCII text by GPT-2 pre-tokenizer pieces, each piece's ids cached.",
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdpool_router_pieces", NULL, -1, module_methods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pdpool_router_pieces(void) {
    init_kinds();
#ifdef HAVE_SHA_NI
    if (sha_ni_usable()) compress_blocks = sha256_compress_ni;
#endif
    if (PyType_Ready(&PieceTableType) < 0 || PyType_Ready(&ApproxTableType) < 0 || PyType_Ready(&ChunkLRUType) < 0)
        return NULL;
    if (monotonic == NULL) {
        PyObject *time = PyImport_ImportModule("time");
        if (time == NULL) return NULL;
        monotonic = PyObject_GetAttrString(time, "monotonic");
        Py_DECREF(time);
        if (monotonic == NULL) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PieceTableType);
    if (PyModule_AddObject(m, "PieceTable", (PyObject *)&PieceTableType) < 0) {
        Py_DECREF(&PieceTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ApproxTableType);
    if (PyModule_AddObject(m, "ApproxTable", (PyObject *)&ApproxTableType) < 0) {
        Py_DECREF(&ApproxTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ChunkLRUType);
    if (PyModule_AddObject(m, "ChunkLRU", (PyObject *)&ChunkLRUType) < 0) {
        Py_DECREF(&ChunkLRUType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
