import tempfile

import chromadb
from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.ragblend import BlendLLM, BlendWarmup, MiniLMEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore

documents = [
    Document(text="Hannibal and Scipio is a stage play written by Thomas Nabbes in 1635."),
    Document(text="Thomas Nabbes was an English dramatist educated at Exeter College, Oxford."),
    Document(text="Exeter College is a college of the University of Oxford, founded in 1314."),
]
Settings.llm = llm = BlendLLM("embedded")
Settings.embed_model = embed = MiniLMEmbedding()  # all-MiniLM-L6-v2 from the local wheel

collection = chromadb.PersistentClient(path=tempfile.mkdtemp()).get_or_create_collection("docs")
index = VectorStoreIndex.from_documents(
    documents,
    storage_context=StorageContext.from_defaults(vector_store=ChromaVectorStore(collection)),
    transformations=[SentenceSplitter(chunk_size=1024), embed, BlendWarmup(llm)],  # + KV warmup
)
llm.wait_for_warmup()

query_engine = index.as_query_engine(similarity_top_k=3)
print(query_engine.query("Where was the author of Hannibal and Scipio educated?"))
print(llm.last_stats.mode, llm.last_stats.chunk_hits, "chunks reused")
