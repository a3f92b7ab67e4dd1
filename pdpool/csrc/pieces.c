/* The router's piece table: token ids of ASCII text through GPT-2's byte-level pre-tokenizer pieces, each piece's
 * ids cached, in C (pdpool.frontend.PieceEncoder's ASCII path without a regex pass, a str per piece, a dict lookup
 * per piece and a JSON join per chunk in Python).
 *
 *   PieceTable(miss, capacity)     miss(piece: str) -> list[int]: the BPE model's ids of a piece not seen yet
 *   table.encode(text) -> (ids, b"1,2,3")   text: an ASCII str; the ids and their JSON without the brackets
 *   chunks(text, chunk_chars) -> [str]      TokenChunkCache's cuts (pdpool/frontend.py), any str
 *   hash_chain(parent, tokens, step, tail)  the engines' chained block hashes (pdpool/block_hash.py), SHA-256 here
 *   sha256_path([name]) -> str              "sha-ni" (x86 SHA extensions, chosen at load where the CPU has them)
 *                                           or "portable"; naming one switches to it (the tests check both)
 *
 * The pieces are those of the GPT-2 pattern on ASCII text (White_Space = \t \n \v \f \r and space):
 *   's|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\s A-Za-z0-9]+|\s+(?!\S)|\s+
 * tests/router/test_token_cache.py checks the pieces against the pattern and the ids against the tokenizer.
 * The table holds at most `capacity` pieces; it is emptied when full (as PieceEncoder's dict is). One thread. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *pieces(PieceTable *self, PyObject *text) {   /* the cuts alone, for the tests */
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

static PyObject *clear(PieceTable *self, PyObject *unused) {
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
static PyObject *chunks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *hash_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *sha256_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
    if (PyType_Ready(&PieceTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PieceTableType);
    if (PyModule_AddObject(m, "PieceTable", (PyObject *)&PieceTableType) < 0) {
        Py_DECREF(&PieceTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
